"""Breakable CUDA graph capture (vLLM's `BreakableCUDAGraphCapture`): one forward captured as a
sequence of CUDA-graph segments with eager calls between them.

Inside `with BreakableCUDAGraphCapture() as cap:` the work on the capture stream is recorded
into a CUDA graph until `cap.add_eager(fn)`: that ends the segment, runs `fn` eagerly (e.g.
attention, whose metadata changes every step), records `fn` itself, and opens the next segment.
`cap.replay()` then runs the segments in order: graph replays and the eager calls, on the same
static buffers the capture used (the caller copies new inputs into them first). As for any
CUDA graph, the capture must run on a side stream (`with torch.cuda.stream(s):`), not the
legacy default one.

Model files only ask `BreakableCUDAGraphCapture.is_active()` (Cohere2-MoE runs its MLP inline
instead of on a side stream while a capture is open). minivllm's runner captures no CUDA graphs
(`cpu_graph.py` is its CPU counterpart), so there it is always False; the class itself works
on any CUDA device and refuses to capture without one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class BreakableCUDAGraphCapture:
    """Stream capture broken by eager calls; one active capture per thread."""

    _tls = threading.local()

    @classmethod
    def current(cls) -> BreakableCUDAGraphCapture | None:
        """The capture open on this thread, if any."""
        return getattr(cls._tls, "active", None)

    @classmethod
    def is_active(cls) -> bool:
        return cls.current() is not None

    def __init__(self, pool: Any | None = None) -> None:
        self.pool = pool                  # a CUDA graph memory pool handle, shared by segments
        self.segments: list[Callable[[], Any]] = []
        self.num_graphs = 0
        self.num_eager_breaks = 0
        self._graph: torch.cuda.CUDAGraph | None = None

    def __enter__(self) -> BreakableCUDAGraphCapture:
        if not torch.cuda.is_available():
            raise RuntimeError("BreakableCUDAGraphCapture needs a CUDA device; on CPU "
                               "minivllm replays steps with compilation.cpu_graph.CPUGraph")
        if self.is_active():
            raise RuntimeError("Nested BreakableCUDAGraphCapture is not supported.")
        BreakableCUDAGraphCapture._tls.active = self
        try:
            self._begin_segment()
        except BaseException:
            BreakableCUDAGraphCapture._tls.active = None
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self._end_segment()
        finally:
            BreakableCUDAGraphCapture._tls.active = None

    def add_eager(self, fn: Callable[[], Any]) -> Any:
        """End the open segment, run `fn` now and at every replay (between the same graph
        segments), open the next segment. Returns `fn`'s capture-time result; replays return
        nothing, so `fn` must write its results into static buffers."""
        if self.current() is not self:
            raise RuntimeError("add_eager outside this capture's `with` block")
        self._end_segment()
        result = fn()
        self.segments.append(fn)
        self.num_eager_breaks += 1
        self._begin_segment()
        return result

    def replay(self) -> None:
        for segment in self.segments:
            segment()

    def _begin_segment(self) -> None:
        assert self._graph is None, "a segment is already being captured"
        graph = torch.cuda.CUDAGraph()
        if self.pool is not None:
            graph.capture_begin(pool=self.pool)
        else:
            graph.capture_begin()
        self._graph = graph

    def _end_segment(self) -> None:
        if self._graph is None:
            return
        self._graph.capture_end()
        self.segments.append(self._graph.replay)
        self.num_graphs += 1
        self._graph = None

    def __repr__(self) -> str:
        return (f"BreakableCUDAGraphCapture(graphs={self.num_graphs}, "
                f"eager_breaks={self.num_eager_breaks})")
