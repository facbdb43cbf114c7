"""CPU graphs: the native kernel calls of one model step, recorded once and replayed.

vLLM captures CUDA graphs of decode steps so that a step costs one graph launch instead of
hundreds of kernel launches from Python. On CPU the same overhead is the Python, module and
dispatcher work around each native kernel: a batch-1 decode step of a 30-layer model makes ~250
native calls but ~10,000 aten calls (views, allocations, checks), and costs ~2x its kernels.

`CPUGraph.capture()` runs one real step while every native function of `_custom_ops` logs its
call (function, arguments: data pointers and sizes); `replay()` makes the same calls again, in
order, from one native loop (`csrc/graph_replay.cpp`; from Python where a kernel has no opcode
there). That is sound only when the step does all of its arithmetic in
those kernels and reads its inputs from the same (static) buffers, so while capturing a
`TorchDispatchMode` checks every torch op: views and allocations pass (allocations are kept
alive, so the recorded pointers stay valid), anything else refuses the capture (`refused` says
which op); such a step simply stays eager. The caller owns the static inputs: it copies each
step's values into them before `replay()` and reads the outputs the capture returned.
"""

import contextlib
import ctypes
import struct
import sys
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
_capturing = threading.local()       # .graph: the CPUGraph this thread is capturing, if any


def refuse_capture(reason: str) -> None:
    """Refuse the capture this thread is running, if any: for work whose calls depend on
    per-step state the recorded calls would not follow (a no-op outside a capture)."""
    graph = getattr(_capturing, "graph", None)
    if graph is not None:
        graph.refuse(reason)


class CPUGraph:
    """One captured step: its native calls, replayed in order on the same buffers."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[..., int], tuple[Any, ...]]] = []
        self.refused: str | None = None          # the first op that made the capture unsound
        self._kept: list[torch.Tensor] = []      # every tensor the capture allocated
        # [num_calls, slots] int64: the calls as graph_replay.cpp's records (None: Python loop)
        self.records: torch.Tensor | None = None

    @contextmanager
    def capture(self) -> Iterator["CPUGraph"]:
        """Run the step inside this block; afterwards `ok` says whether it can be replayed."""
        lib = ops.native_lib()
        if lib is None:
            raise RuntimeError("CPU graphs need the native kernels (none are loaded)")
        originals = {name: getattr(lib, name) for name in lib.function_names()
                     if not _is_query(name)}
        for name, fn in originals.items():
            setattr(lib, name, _recording(fn, self.calls))
        guard = _CaptureGuard(self)
        _capturing.graph = self
        try:
            with _compiled_functions_run_eagerly(), guard:
                yield self
        finally:
            _capturing.graph = None
            for name, fn in originals.items():
                setattr(lib, name, fn)
        if not self.calls and self.refused is None:
            self.refused = "no native kernel ran"
        if self.ok:
            self.records = _native_records(lib, self.calls)

    @property
    def ok(self) -> bool:
        return self.refused is None

    def replay(self, native: bool = True) -> None:
        """The captured calls again (their inputs: whatever the static buffers hold now), from
        the native loop unless `native` is False or some call has no opcode there."""
        if native and self.records is not None:
            failed_at = ctypes.c_int64(0)
            rc = _replay_api(ops.native_lib()).replay(
                self.records.data_ptr(), self.records.shape[0], ctypes.byref(failed_at))
            if rc != 0:
                name = self.calls[failed_at.value][0].__name__
                raise RuntimeError(f"CPU graph replay: {name} returned {rc}")
            return
        for fn, args in self.calls:
            rc = fn(*args)
            if rc != 0:
                raise RuntimeError(f"CPU graph replay: {fn.__name__} returned {rc}")

    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason


def _is_query(name: str) -> bool:
    return "_has_" in name             # capability queries are not step work


class _ReplayAPI:
    """csrc/graph_replay.cpp's entry points (not kernels: a graph never records them)."""

    def __init__(self, cdll: ctypes.CDLL) -> None:
        i64 = ctypes.c_int64
        self.opcode = cdll.minivllm_graph_opcode           # (name) -> opcode, or -1
        self.opcode.argtypes, self.opcode.restype = [ctypes.c_char_p], ctypes.c_int
        self.slots = int(cdll.minivllm_graph_record_slots())
        self.replay = cdll.minivllm_graph_replay           # (records, n, failed_at) -> rc
        self.replay.argtypes = [ctypes.c_void_p, i64, ctypes.POINTER(i64)]
        self.replay.restype = ctypes.c_int


_apis: dict[int, _ReplayAPI] = {}


def _replay_api(lib: ops.NativeLibrary) -> _ReplayAPI:
    key = id(lib.cdll)
    if key not in _apis:
        _apis[key] = _ReplayAPI(lib.cdll)
    return _apis[key]


def _native_records(lib: ops.NativeLibrary, calls: list) -> torch.Tensor | None:
    """The calls as records [opcode, arguments...] for `minivllm_graph_replay`: pointers and
    integers as their values, floats as their bits; None when some kernel has no opcode."""
    api = _replay_api(lib)
    slots = api.slots
    rows = []
    for fn, args in calls:
        opcode = api.opcode(fn.__name__.encode())
        if opcode < 0 or len(args) >= slots:
            return None
        rows.append([opcode, *map(_slot_value, args)] + [0] * (slots - 1 - len(args)))
    return torch.tensor(rows, dtype=torch.int64)


def _slot_value(arg: Any) -> int:
    if isinstance(arg, ctypes.c_float):
        return struct.unpack("<I", struct.pack("<f", arg.value))[0]
    return arg.value or 0          # a null c_void_p's value is None


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


def _compiled_functions_run_eagerly() -> contextlib.AbstractContextManager:
    """A model file's own `@torch.compile` helper (vLLM's Cohere2-MoE routing) called during a
    capture would trace `_CaptureGuard.__torch_dispatch__` (not skipped, see there) and
    recompile at every op until dynamo's recompile limit; run it eagerly instead (its torch
    ops then refuse the capture, as any other). Only where dynamo is loaded already."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


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
