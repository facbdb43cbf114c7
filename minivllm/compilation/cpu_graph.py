"""CPU graphs: the native kernel calls of one model step, recorded once and replayed.

vLLM captures CUDA graphs of decode steps so that a step costs one graph launch instead of
hundreds of kernel launches from Python. On CPU the same overhead is the Python, module and
dispatcher work around each native kernel: a batch-1 decode step of a 30-layer model makes ~250
native calls but ~10,000 aten calls (views, allocations, checks), and costs ~2x its kernels.

`CPUGraph.capture()` runs one real step while every native function of `_custom_ops` logs its
call (function, arguments: data pointers and sizes); `replay()` makes the same calls again, in
order, from one Python loop. That is sound only when the step does all of its arithmetic in
those kernels and reads its inputs from the same (static) buffers, so while capturing a
`TorchDispatchMode` checks every torch op: views and allocations pass (allocations are kept
alive, so the recorded pointers stay valid), anything else refuses the capture (`refused` says
which op); such a step simply stays eager. The caller owns the static inputs: it copies each
step's values into them before `replay()` and reads the outputs the capture returned.
"""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm import _custom_ops as ops

# Fresh allocations (uninitialised: nothing is computed). Any other op passes only when it is a
# view: not mutating, and every tensor it returns lies in its first argument's storage (this
# covers reshape/flatten/contiguous/to when they return views or the input itself).
_ALLOC_OPS = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided",
                        "empty_like"})
_OWN_NAMESPACE = "minivllm"


class CPUGraph:
    """One captured step: its native calls, replayed in order on the same buffers."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[..., int], tuple[Any, ...]]] = []
        self.refused: str | None = None          # the first op that made the capture unsound
        self._kept: list[torch.Tensor] = []      # every tensor the capture allocated

    @contextmanager
    def capture(self) -> Iterator["CPUGraph"]:
        """Run the step inside this block; afterwards `ok` says whether it can be replayed."""
        lib = ops.native_lib()
        if lib is None:
            raise RuntimeError("CPU graphs need the native kernels (none are loaded)")
        originals = {name: getattr(lib, name) for name in lib.function_names()
                     if "_has_" not in name}     # capability queries are not step work
        for name, fn in originals.items():
            setattr(lib, name, _recording(fn, self.calls))
        guard = _CaptureGuard(self)
        try:
            with guard:
                yield self
        finally:
            for name, fn in originals.items():
                setattr(lib, name, fn)
        if not self.calls and self.refused is None:
            self.refused = "no native kernel ran"

    @property
    def ok(self) -> bool:
        return self.refused is None

    def replay(self) -> None:
        """The captured calls again (their inputs: whatever the static buffers hold now)."""
        for fn, args in self.calls:
            rc = fn(*args)
            if rc != 0:
                raise RuntimeError(f"CPU graph replay: {fn.__name__} returned {rc}")

    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason


def _recording(fn: Callable[..., int], calls: list) -> Callable[..., int]:
    thread = threading.get_ident()

    def record(*args: Any) -> int:
        # Only the capturing thread's calls belong to the step (a server has other threads).
        if threading.get_ident() == thread:
            # Kept as ctypes values: a replayed call then skips the conversion (~1 us of ~2).
            calls.append((fn, tuple(map(_as_ctype, fn.argtypes, args))))
        return fn(*args)
    record.__name__ = fn.__name__
    return record


def _as_ctype(ctype: Any, value: Any) -> Any:
    return value if isinstance(value, ctype) else ctype(value)


class _CaptureGuard(TorchDispatchMode):
    """Lets views and allocations through (keeping what they allocate) and refuses the capture
    on any other torch op; looks inside minivllm's own ops (they run torch code too)."""

    def __init__(self, graph: CPUGraph) -> None:
        super().__init__()
        self.graph = graph

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # NOTE: torch wraps a mode's __torch_dispatch__ in a dynamo-disable unless this says
        # False; that wrapper imports torch._dynamo (with sympy and inductor: ~1.5-2 s and ~70 MB
        # of a cold `minivllm generate`) at the first capture. Captures run eagerly, never traced.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == _OWN_NAMESPACE:
            with _CaptureGuard(self.graph):     # the handler runs with this mode popped
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if name in _ALLOC_OPS:
            self.graph._kept.append(out)
        elif not _is_view(func, args, out):
            self.graph.refuse(f"torch op {func} ran")
        return out


def _is_view(func: Any, args: tuple, out: Any) -> bool:
    if func._schema.is_mutable or not args or not isinstance(args[0], torch.Tensor):
        return False
    base = args[0].untyped_storage().data_ptr()
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return all(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() == base
               for o in outs)
