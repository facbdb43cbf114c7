"""gguf_amx.cpp, the GGUF linears of 5+ bf16 rows on AMX CPUs: bf16 strips of the packed weight
(file or x8 layout) into AMX tile products, bit-exact to the bf16 GEMM on the dequantised
weight."""

import pytest
import torch
from gguf import GGMLQuantizationType as T

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels import gguf_linear as gl
from tests.csrc.test_gguf_gemm import K_QUANTS, random_weight

pytestmark = pytest.mark.requires_native


def test_amx_prompt_path_matches_dequantised_linear():
    if not ops._has_amx:
        pytest.skip("no AMX here: prompt chunks use dequantised tiles + F.linear")
    qw = torch.from_numpy(random_weight(T.Q8_0, 2048 + 96, 576))  # several tiles, ragged last
    w = gl.gguf_dequantize(qw, T.Q8_0, torch.bfloat16)
    x = torch.randn(70, 576).bfloat16()
    b = torch.randn(qw.shape[0]).bfloat16()
    y = gl.gguf_linear(x, qw, T.Q8_0, b)
    torch.testing.assert_close(y, ops.gemm_bf16(x, w, b), atol=0, rtol=0)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K],
                         ids=lambda t: T(t).name)
def test_amx_path_equals_bf16_gemm_of_dequantised_weight(qtype, monkeypatch):
    """gguf_amx.cpp (5+ bf16 rows, 9+ for x8 weights of K < 1024): each type's bf16 strip dequantiser and the tile passes give
    the bf16 AMX GEMM's results on the dequantised weight bit for bit: 7 blocks of 16 rows over
    2 threads (a one-strip panel at a thread's end), 1-4 groups of 16 rows of x, ragged units;
    the same weight in the x8 layout (its 16-row groups un-interleaved in the strips) too."""
    if not ops._has_amx:
        pytest.skip("no AMX here")
    cols = 512 if qtype in K_QUANTS else 544
    qw = torch.from_numpy(random_weight(qtype, 112, cols, seed=int(qtype)))
    w = gl.gguf_dequantize(qw, qtype, torch.bfloat16)
    gl._resolve()                                              # before the capabilities are set
    monkeypatch.setattr(gl._Native, "x8", True)                # as with MINIVLLM_GGUF_X8=1
    x8 = qw.clone()
    code = gl.gguf_repack_for_cpu(x8, qtype)
    assert code == qtype | gl.GGUF_X8_LAYOUT
    gen = torch.Generator().manual_seed(int(qtype))
    monkeypatch.setattr(gl, "GGUF_AMX_MAX_ROWS", 1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for m in (5, 9, 37, 70) if qtype != T.Q4_1 else (5, 9, 37, 70, 1000):  # 1000: 2 chunks
            x = torch.randn(m, cols, generator=gen).bfloat16()
            b = torch.randn(112, generator=gen).bfloat16()
            y = gl.gguf_linear(x, qw, qtype, b)
            assert torch.equal(y, ops.gemm_bf16(x, w, b)), f"m={m}"
            if m > gl.gguf_dot_max_rows(code, cols):         # (fewer: the x8 dot kernels)
                assert torch.equal(gl.gguf_linear(x, x8, code, b), y), f"x8, m={m}"
    finally:
        torch.set_num_threads(threads)
