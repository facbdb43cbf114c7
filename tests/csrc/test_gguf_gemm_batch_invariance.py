"""GGUF linears in decode steps give each row the same bits whatever the step's row count (the
int8 dot kernels up to 4 rows, the x8 passes, the x^T tiles from 16) for weights in the CPU
layout, which the model's weights take on these CPUs: a request's tokens do not depend on its
batch, and speculative decoding's verify step reproduces single-token decoding. (Weights left
in the file layout, whose row count is no whole x8 group, keep that up to 15 rows; from 16 the
tiles sum some types in another order.) On AMX CPUs that holds up to `gguf_dot_max_rows` rows
(8 or 16 by K for x8 weights); more take the bf16 strips, another rounding."""

import pytest
import torch
from gguf import GGMLQuantizationType as T

from minivllm.model_executor.kernels import gguf_linear as gl
from tests.csrc.test_gguf_gemm import K_QUANTS, LEGACY, _step, random_weight

pytestmark = pytest.mark.requires_native


@pytest.mark.parametrize("repack", [False, True], ids=["file_layout", "cpu_layout"])
@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=lambda t: T(t).name)
def test_each_row_equals_its_one_row_product(qtype, repack):
    if not gl._resolve() or not gl._Native.int8_decode:
        pytest.skip("no int8 GGUF kernels on this CPU (the dequantised path is row-wise)")
    for cols in (512, 1024) if qtype in K_QUANTS else (608, 1056):     # K under / from 1024
        qw = torch.from_numpy(random_weight(qtype, 96, cols, seed=5).copy())
        kernel_type = gl.gguf_repack_for_cpu(qw, qtype) if repack else qtype
        gen = torch.Generator().manual_seed(int(qtype))
        x = torch.randn(24, cols, generator=gen).bfloat16()
        bias = torch.randn(96, generator=gen).bfloat16()
        with _step(1, 1):
            alone = torch.cat([gl.gguf_linear(x[i:i + 1], qw, kernel_type, bias)
                               for i in range(24)])
        counts = (2, 4, 5, 8, 15, 16, 17, 24) if repack else (2, 4, 5, 8, 15)
        limit = gl.gguf_dot_max_rows(kernel_type, cols) if gl._Native.amx else 24
        if gl._Native.amx and repack:
            assert limit == (16 if cols >= 1024 else 8)
        for m in counts:
            with _step(m, m):                            # a decode step of m requests
                y = gl.gguf_linear(x[:m], qw, kernel_type, bias)
            # (past the limit on AMX: the strips' bf16 products)
            assert torch.equal(y, alone[:m]) == (m <= limit), (cols, m)
