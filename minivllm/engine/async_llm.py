"""AsyncLLM: the synchronous LLMEngine driven by one background thread, fed by asyncio handlers.

Every HTTP request becomes an engine request; the thread steps the engine while any request is
unfinished, so concurrent requests share each forward pass (continuous batching). The engine is
not thread-safe: only the loop thread touches it. Handlers talk to the thread through a command
deque (add / abort) under a lock, and the thread hands outputs back through per-request asyncio
queues with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.engine_calls import EngineCallsMixin, EngineDeadError, QueueFullError
from minivllm.engine.engine_thread import EngineThread, put_all_soon, run_call, settle
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.pause_mixin import PauseMixin
from minivllm.engine.request_stream import (STREAM_FINISHED, RequestStream, _Stream,
                                            outputs_of_kind)
from minivllm.inputs import PromptType
from minivllm.lora.request import LoRARequest
from minivllm.logger import init_logger
from minivllm.outputs import PoolingRequestOutput, RequestOutput
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams
from minivllm.v1.spec_decode.metrics import SpecDecodingStats

logger = init_logger(__name__)

_IDLE_WAIT_S = 1.0   # how long the idle loop sleeps before re-checking the stop flag


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the loop thread publishes after each step (read by /metrics and admission)."""

    num_running: int = 0
    num_waiting: int = 0          # sequences waiting in the scheduler
    kv_cache_usage: float = 0.0   # fraction of KV blocks held by requests
    spec_decoding: SpecDecodingStats | None = None   # totals, when the engine speculates


class StatLogger(Protocol):
    """Receives per-request timings from the loop thread (must be thread-safe)."""

    def on_request_added(self, num_prompt_tokens: int) -> None: ...

    def on_new_tokens(self, num_new_tokens: int, ttft_s: float | None, itl_s: float | None) -> None: ...

    def on_request_finished(self, finish_reason: str, e2e_s: float) -> None: ...


class _Completed:
    """An awaitable that is already done: what `abort` returns."""

    def __await__(self):
        return iter(())


_DONE = _Completed()


class AsyncLLM(EngineCallsMixin, PauseMixin):
    """Runs an `LLMEngine` in one thread; `add_request` and `abort` may be called from asyncio."""

    def __init__(self, engine: Any, *, max_num_queued_requests: int = 1024,
                 stall_timeout_s: float = 60.0, vocab_size: int | None = None,
                 model_path: str | None = None) -> None:
        if max_num_queued_requests < 1:
            raise ValueError(f"max_num_queued_requests must be at least 1, got {max_num_queued_requests}.")
        self.engine = engine
        self.max_model_len: int = engine.max_model_len
        self.max_num_queued_requests = max_num_queued_requests
        self.stall_timeout_s = stall_timeout_s
        self.vocab_size = vocab_size
        self.model_path = model_path
        # NOTE: a private copy for the handlers: HF fast tokenizers must not be used from two
        # threads at once, and the loop thread detokenizes with the engine's.
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        self.eos_token_id: int | None = getattr(engine, "eos_token_id", None)   # beam search
        # --reasoning-parser (stateless after construction): the server's reasoning split
        self.reasoning_parser = getattr(engine, "reasoning_parser", None)
        self.stat_loggers: list[StatLogger] = []
        self.request_logger: Any = None   # --enable-log-requests: entrypoints/logger.py
        self.stats = EngineStats()
        self.dead_error: BaseException | None = None
        self.last_progress_s = time.monotonic()
        self._lock = threading.Lock()
        self._commands: deque[tuple] = deque()
        self._streams: dict[str, _Stream] = {}
        self._num_pending_seqs = 0
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._owns_engine = False   # from_engine_args: shutdown() also ends the engine
        self._host: EngineThread | None = None   # from_engine_args: the thread that built it

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """An LLMEngine built by `LLMEngine.from_engine_args` on the thread that will step it
        (engine_thread.py says why), owned (and shut down) by this."""
        host = EngineThread()
        try:
            engine = host.call(LLMEngine.from_engine_args, engine_args)
        except BaseException:
            host.close()
            raise
        model_config = engine.vllm_config.model_config
        kwargs.setdefault("max_num_queued_requests", engine_args.max_num_queued_requests)
        try:
            async_llm = cls(engine, vocab_size=model_config.get_vocab_size(),
                            model_path=model_config.model, **kwargs)
        except BaseException:
            host.close()
            engine.shutdown()
            raise
        async_llm._owns_engine = True
        async_llm._host = host
        return async_llm

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Starts the loop thread (idempotent)."""
        if self._thread is not None:
            return
        if self._host is not None:
            self._thread = self._host.thread
            self._host.submit(self._run_loop)
            self._host.close()   # the thread ends when the loop does
            return
        self._thread = threading.Thread(target=self._run_loop, name="minivllm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops the loop; in-flight requests fail with EngineDeadError and /health turns 503."""
        self._stop.set()
        self._wakeup.set()
        if self._host is not None and self._thread is None:
            self._host.close()   # never started
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def shutdown(self) -> None:
        self.stop()
        if self._owns_engine:
            self.engine.shutdown()

    def check_health(self) -> str | None:
        """None when healthy, else why not: the loop died, or made no progress with work waiting."""
        if self.dead_error is not None:
            return f"The engine loop is dead: {self.dead_error}"
        if self._thread is None or not self._thread.is_alive():
            return "The engine loop is not running."
        stalled_s = time.monotonic() - self.last_progress_s
        if self._streams and stalled_s > self.stall_timeout_s:
            return (f"The engine made no progress for {stalled_s:.0f}s with "
                    f"{len(self._streams)} requests in flight.")
        return None

    # ------------------------------------------------------------------ handler side

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> RequestStream:
        """Submits a request (`lora_request`: its adapter, None for the base model); raises
        EngineDeadError, QueueFullError or ValueError (duplicate id).

        Errors found by the engine itself (e.g. a bad prompt) arrive through the stream.
        """
        if self.dead_error is not None or self._stop.is_set():
            raise EngineDeadError(f"The engine loop is not running: {self.dead_error or 'stopped'}")
        if priority and not getattr(getattr(self.engine, "scheduler", None), "by_priority", False):
            raise ValueError(f"priority {priority} needs priority scheduling; start the server "
                             "with --scheduling-policy priority.")
        if self.request_logger is not None:
            self.request_logger.log_inputs(request_id, prompt, params, lora_request)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n, time.monotonic())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"Request id {request_id!r} is already in use.")
            num_queued = self.num_queued
            if num_queued + params.n > self.max_num_queued_requests:
                raise QueueFullError(
                    f"The server is busy: {num_queued} sequences are waiting "
                    f"(--max-num-queued-requests={self.max_num_queued_requests}); retry later.")
            self._streams[request_id] = stream
            self._num_pending_seqs += params.n
            self._commands.append(("add", request_id, prompt, params, lora_request, priority))
        self._wakeup.set()
        return RequestStream(request_id, stream, self.abort)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, *, lora_request: LoRARequest | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """vLLM's: the request's outputs as `sampling_params.output_kind` asks (cumulative,
        deltas, or the final one only); leaving the loop early aborts the request."""
        stream = self.add_request(request_id, prompt, sampling_params, lora_request, priority)
        async for output in outputs_of_kind(stream.outputs(), sampling_params.output_kind):
            yield output

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str,
                     *, lora_request: LoRARequest | None = None,
                     priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's: a pooling model's output for one prompt (one final output)."""
        stream = self.add_request(request_id, prompt, pooling_params, lora_request, priority)
        async for output in stream.outputs():
            yield output

    def abort(self, request_id: str | Iterable[str]) -> Awaitable[None]:
        """Aborts requests (no-op when unknown or finished); frees their KV blocks next step.
        Returns an awaitable: vLLM's callers `await engine.abort(...)`, handlers here need not."""
        for one in [request_id] if isinstance(request_id, str) else list(request_id):
            self._abort_one(one)
        return _DONE

    def _abort_one(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return
            if stream.admitted:   # its final output ("abort") comes from the loop thread
                self._commands.append(("abort", request_id, stream))
            else:
                self._num_pending_seqs -= stream.num_seqs   # its add command will be skipped
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, STREAM_FINISHED)
        self._wakeup.set()
        # Count its end here (vLLM's request_success series with finished_reason="abort").
        for stat_logger in self.stat_loggers:
            stat_logger.on_request_finished("abort", time.monotonic() - stream.arrival_s)

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Sequences not running yet: submitted but not handed to the engine, or waiting in it."""
        return self._num_pending_seqs + self.stats.num_waiting

    # ------------------------------------------------------------------ loop thread

    def _run_loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self.last_progress_s = time.monotonic()   # idle is not a stall
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
                    self.last_progress_s = time.monotonic()
                    continue
                outputs = self.engine.step()
                now = time.monotonic()
                self.last_progress_s = now
                self._publish_stats()
                self._dispatch(outputs, now)
            error: BaseException = EngineDeadError("The engine loop was stopped.")
        except BaseException as exc:   # noqa: BLE001 - any crash must fail the requests, not hang them
            logger.exception("The engine loop crashed; failing all in-flight requests.")
            error = EngineDeadError(f"{type(exc).__name__}: {exc}")
        self.dead_error = error
        self._fail_all(error)

    def _apply_commands(self) -> None:
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
            # NOTE: adds happen under the lock, so an abort racing with an add sees either a
            # pending request (and cancels the add) or an admitted one (and aborts it).
            for command in commands:
                if command[0] == "abort":
                    # A consumer still reading (`await engine.abort(id)`) gets the final
                    # output, finish_reason "abort"; nobody reads it after a disconnect.
                    final = self.engine.abort_with_outputs(command[1])
                    stream = command[2]
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                                     final[-1] if final else STREAM_FINISHED)
                elif command[0] == "call":
                    run_call(self.engine, *command[1:])
                elif self._paused:       # pause_generation: held until resume
                    self._commands.append(command)
                else:
                    self._add_to_engine(*command[1:])
            if commands:
                self._publish_stats()

    def _add_to_engine(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       lora_request: LoRARequest | None = None, priority: int = 0) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return   # aborted before it reached the engine
        self._num_pending_seqs -= stream.num_seqs
        try:
            self.engine.add_request(request_id, prompt, params, arrival_time=time.time(),
                                    lora_request=lora_request, priority=priority)
        except ValueError as exc:
            del self._streams[request_id]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            return
        stream.admitted = True
        num_prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
        for stat_logger in self.stat_loggers:
            stat_logger.on_request_added(num_prompt_tokens)

    def _publish_stats(self) -> None:
        scheduler = self.engine.scheduler
        self.stats = EngineStats(num_running=scheduler.num_running,
                                 num_waiting=scheduler.num_waiting,
                                 kv_cache_usage=scheduler.kv_cache_usage,
                                 spec_decoding=copy.deepcopy(scheduler.spec_stats))

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        """Hands each output to its request's queue: one thread-safe call per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = defaultdict(list)
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue   # aborted meanwhile
                if output.finished:
                    del self._streams[output.request_id]
                self._record_timings(stream, output, now)
                batches[stream.loop].append((stream.queue, output))
        for loop, items in batches.items():
            put_all_soon(loop, items)

    def _record_timings(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        if not isinstance(output.outputs, list):   # a pooling request: one output, no tokens
            for stat_logger in self.stat_loggers:
                stat_logger.on_request_finished("stop", now - stream.arrival_s)
            return
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        num_new = num_tokens - stream.num_tokens
        if num_new > 0 and self.stat_loggers:
            ttft = now - stream.arrival_s if stream.last_token_s is None else None
            itl = now - stream.last_token_s if stream.last_token_s is not None else None
            for stat_logger in self.stat_loggers:
                stat_logger.on_new_tokens(num_new, ttft, itl)
        if num_new > 0:
            stream.num_tokens, stream.last_token_s = num_tokens, now
        if output.finished:
            reason = output.outputs[0].finish_reason or "abort"
            for stat_logger in self.stat_loggers:
                stat_logger.on_request_finished(reason, now - stream.arrival_s)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            calls = [command for command in self._commands if command[0] == "call"]
            self._commands.clear()
            self._num_pending_seqs = 0
            self.stats = EngineStats()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = defaultdict(list)
        for stream in streams:
            batches[stream.loop].append((stream.queue, error))
        for _, _, _, future in calls:   # engine calls still queued fail too
            settle(future, None, error)
        for loop, items in batches.items():
            put_all_soon(loop, items)

