"""The one thread that builds an engine and then steps it (AsyncLLM's loop thread), and the
hand-offs from it to the asyncio side (futures settled and queues fed through call_soon_threadsafe).

Why the engine is built there and not by the caller: libgomp keeps one pool of OpenMP worker
threads per thread that ever ran a parallel region, and as soon as its pools hold more threads
than the machine has cores it stops spinning at barriers (each worker sleeps on a futex between
parallel regions and is woken for the next). Loading the model and capturing CPU graphs on the
server's main thread left a second pool behind: on 2 cores every served decode step then paid
~120 sleeps and wake-ups per worker, ~2-3 ms a token at batch 1 (served 0.80-0.85x the offline
engine's tok/s). With all torch compute on this thread there is one pool, as offline.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread running submitted calls one after another, in submission order."""

    def __init__(self, name: str = "minivllm-engine") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple, Future] | None] = (
            queue.SimpleQueue())
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        """Runs `fn(*args)` on the thread after the calls submitted before it."""
        future: Future = Future()
        self._jobs.put((fn, args, future))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`submit(fn, *args)` and wait: returns its result or raises its exception here."""
        return self.submit(fn, *args).result()

    def close(self) -> None:
        """The thread ends after the calls already submitted (does not wait for them)."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:   # noqa: BLE001 - handed to whoever waits on it
                future.set_exception(exc)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


def put_all_soon(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> None:
    """Feeds each (queue, item) pair on `loop`, from any thread: one wake-up for all of them."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:
        pass   # the event loop is closed: nobody is listening any more


def run_call(engine: Any, method: str, args: tuple, future: asyncio.Future) -> None:
    """`engine.<method>(*args)` here; its result or exception settles `future` on its loop."""
    try:
        result, error = getattr(engine, method)(*args), None
    except Exception as exc:   # noqa: BLE001 - handed to the caller's coroutine
        result, error = None, exc
    settle(future, result, error)


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Sets `future`'s result (or `error`) on its own loop, from any thread."""
    def set_outcome() -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)
    try:
        future.get_loop().call_soon_threadsafe(set_outcome)
    except RuntimeError:
        pass   # the event loop is closed
