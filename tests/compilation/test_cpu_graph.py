"""CPUGraph: native calls recorded while a step runs, replayed on new buffer contents; any torch
op that computes refuses the capture."""

import pytest
import torch

from minivllm import _custom_ops as ops
from minivllm.compilation.cpu_graph import CPUGraph, _is_query, _replay_api

pytestmark = pytest.mark.requires_native


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """RMSNorm then SiluAndMul, both native, with views and allocations in between."""
    y = ops.rms_norm_bf16(x.view(x.shape[0], -1), w, 1e-6)        # [M, 2d]
    return ops.silu_and_mul_bf16(y[:, :].reshape(x.shape[0], -1))   # [M, d]


def _kernels_or_skip():
    if ops.rms_norm_bf16(torch.zeros(1, 16, dtype=torch.bfloat16),
                         torch.ones(16, dtype=torch.bfloat16), 1e-6) is None:
        pytest.skip("no AVX-512 here: RMSNorm stays torch.rms_norm")


def _captured(rows: int = 3):
    """A graph of `_step` on random x [rows, 64], w [64]: (graph, x, w, its output)."""
    _kernels_or_skip()
    x = torch.randn(rows, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    graph = CPUGraph()
    with graph.capture():
        out = _step(x, w)
    return graph, x, w, out


def test_replay_recomputes_from_the_static_inputs():
    graph, x, w, out = _captured()
    assert graph.ok, graph.refused
    assert [fn.__name__ for fn, _ in graph.calls] == ["minivllm_rms_norm_bf16",
                                                      "minivllm_silu_mul_bf16"]
    assert torch.equal(out, _step(x, w))
    for seed in range(3):                               # new values in the same buffer
        x.copy_(torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)).bfloat16())
        graph.replay()
        assert torch.equal(out, _step(x, w))


def test_a_computing_torch_op_refuses_the_capture():
    _kernels_or_skip()
    x = torch.randn(2, 64).bfloat16()
    w = torch.ones(64).bfloat16()
    graph = CPUGraph()
    with graph.capture():
        _step(x + 1, w)                                 # the add would not be replayed
    assert not graph.ok and "aten.add" in graph.refused
    graph = CPUGraph()
    with graph.capture():
        x.clone()
    assert not graph.ok                                 # no native call, and a copy


def test_capture_restores_the_library():
    lib = ops.native_lib()
    before = lib.minivllm_rms_norm_bf16
    with CPUGraph().capture():
        assert lib.minivllm_rms_norm_bf16 is not before
    assert lib.minivllm_rms_norm_bf16 is before


def test_only_the_capturing_threads_calls_are_recorded():
    _kernels_or_skip()
    import threading
    x = torch.randn(2, 64).bfloat16()
    w = torch.ones(64).bfloat16()
    other = threading.Thread(target=_step, args=(x.clone(), w))
    graph = CPUGraph()
    with graph.capture():
        other.start()
        other.join()
        _step(x, w)
    assert graph.ok and len(graph.calls) == 2


def test_native_replay_equals_the_python_loop():
    graph, x, w, out = _captured()
    assert graph.records is not None and graph.records.shape[0] == 2   # one record per call
    for seed in range(3):
        x.copy_(torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)).bfloat16())
        graph.replay(native=False)
        from_python = out.clone()
        out.zero_()
        graph.replay()
        assert torch.equal(out, from_python)
        assert torch.equal(out, _step(x, w))


def test_every_recordable_kernel_has_an_opcode():
    # A kernel the native loop cannot run would silently send its graphs back to Python.
    lib = ops.native_lib()
    missing = [name for name in lib.function_names()
               if not _is_query(name) and _replay_api(lib).opcode(name.encode()) < 0]
    assert missing == []


def test_a_failing_replayed_call_is_named():
    graph = _captured(rows=2)[0]
    graph.records[1, 6] = -1              # silu_mul's d < 0: the kernel returns 1
    with pytest.raises(RuntimeError, match="minivllm_silu_mul_bf16 returned 1"):
        graph.replay()
