"""AsyncLLM's pause / resume (vLLM's `pause_generation` / `resume_generation` / `is_paused`):
an RL trainer stops generation to update the weights, then lets it go on.

While paused, requests are accepted but held before the engine (the loop thread keeps their
"add" commands queued), so clients simply wait; in-flight requests are either aborted at once,
each ending with finish_reason "abort" and what it generated so far, or allowed to finish
(`wait_for_inflight_requests=True`). `clear_cache` then forgets the prefix cache, whose KV was
computed with the weights about to change.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

# How often a pause waiting for in-flight requests looks again.
_DRAIN_POLL_S = 0.02


class GenerationAborted(Exception):
    """A pooling request cut off by pause_generation (it has no partial result to return)."""


class PauseMixin:
    """Needs AsyncLLM's `_lock`, `_streams`, `_wakeup`, `_call_engine`, `_dispatch` and
    `reset_prefix_cache`; its loop holds "add" commands while `_paused`."""

    _lock: threading.Lock
    _streams: dict[str, Any]
    _wakeup: threading.Event
    _paused: bool = False

    async def pause_generation(self, *, wait_for_inflight_requests: bool = False,
                               clear_cache: bool = True) -> None:
        """Holds new requests; aborts (default) or drains the in-flight ones; then, with
        `clear_cache`, resets the prefix cache. Pausing a paused engine only does the rest."""
        with self._lock:
            self._paused = True
        if wait_for_inflight_requests:
            while self._admitted_ids():
                await asyncio.sleep(_DRAIN_POLL_S)
        else:
            await self._abort_admitted()
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        """Lets held and new requests reach the engine again."""
        with self._lock:
            self._paused = False
        self._wakeup.set()

    async def is_paused(self) -> bool:
        return self._paused

    def _admitted_ids(self) -> list[str]:
        with self._lock:
            return [rid for rid, stream in self._streams.items() if stream.admitted]

    async def _abort_admitted(self) -> None:
        """Every request the engine holds ends now; its client gets the final output."""
        ids = self._admitted_ids()
        if not ids:
            return
        outputs = await self._call_engine("abort_with_outputs", ids)
        self._dispatch(outputs, time.monotonic())
        answered = {o.request_id for o in outputs}
        for request_id in ids:
            if request_id not in answered:      # a pooling request: no partial result
                self._fail_stream(request_id, GenerationAborted(
                    "The request was aborted: generation was paused (pause_generation)"))

    def _fail_stream(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
