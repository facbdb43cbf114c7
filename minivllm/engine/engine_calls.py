"""AsyncLLM's calls into the engine between two steps (vLLM's async methods: adapters, prefix
cache, sleep mode, profiler, collective_rpc), vLLM's small EngineClient queries
(`get_tokenizer`, `model_config`, `is_running`, `errored`), and the errors handlers see."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from minivllm.lora.request import LoRARequest


class EngineDeadError(RuntimeError):
    """The engine loop stopped or crashed; in-flight and new requests fail with this."""


class QueueFullError(RuntimeError):
    """More requests wait than --max-num-queued-requests allows (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineCallsMixin:
    """Needs AsyncLLM's `_lock`, `_commands`, `_wakeup`, `_stop` and `dead_error`: each call
    queues ("call", method, args, future) for the loop thread, which runs it on the engine."""

    _lock: threading.Lock
    _commands: deque
    _wakeup: threading.Event
    _stop: threading.Event
    _thread: threading.Thread | None
    dead_error: BaseException | None
    engine: Any
    tokenizer: Any

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """`LLMEngine.add_lora` on the loop thread (a ValueError when the adapter does not fit)."""
        return await self._call_engine("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call_engine("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        return await self._call_engine("list_loras")

    async def get_tokenizer(self) -> Any:
        """vLLM's: the handlers' tokenizer (None with skip_tokenizer_init)."""
        return self.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.vllm_config.model_config

    @property
    def is_running(self) -> bool:
        """The loop thread is stepping (or waiting for work)."""
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def errored(self) -> bool:
        """The loop crashed or was stopped: requests fail with `dead_error`."""
        return self.dead_error is not None

    async def reset_prefix_cache(self) -> bool:
        """vLLM's: forgets the cached KV blocks (False while requests hold blocks)."""
        return await self._call_engine("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> None:
        """vLLM's: `LLMEngine.sleep` between two steps."""
        await self._call_engine("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call_engine("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self._call_engine("is_sleeping")

    async def start_profile(self) -> None:
        await self._call_engine("start_profile")

    async def stop_profile(self) -> None:
        await self._call_engine("stop_profile")

    async def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                             args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """`LLMEngine.collective_rpc` between two steps (every rank's result, in rank order)."""
        return await self._call_engine("collective_rpc", method, timeout, tuple(args), kwargs)

    async def _call_engine(self, method: str, *args: Any) -> Any:
        """Runs `engine.<method>(*args)` between two steps: only the loop thread touches it."""
        if self.dead_error is not None or self._stop.is_set():
            raise EngineDeadError(f"The engine loop is not running: {self.dead_error or 'stopped'}")
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._commands.append(("call", method, args, future))
        self._wakeup.set()
        return await future
