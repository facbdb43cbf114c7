"""CPU routing of plain-weight linears: AMX GEMM, GEMV or oneDNN's packed copy, by row count.

bf16 weights on CPU get, once after loading (`pack_for_cpu`), a oneDNN-blocked copy and two
eligibility flags; each call then picks (`cpu_linear`, x [T, in] -> [T, out]):
- T <= `weight._amx_rows` (decode steps; prompt chunks of <= 1024 rows for weights that fit two
  cores' L2): the native AMX GEMM on the plain row-major weight (`csrc/gemm_amx.cpp`);
- T <= `GEMV_MAX_ROWS` (8), weights the AMX GEMM does not take (CPUs without AMX, or a row
  count that is no multiple of 16): the native AVX-512 / AVX2 bf16 GEMV (`csrc/gemv.cpp`);
- otherwise (long prompt chunks, the LM head): oneDNN's matmul on the packed copy, or from
  `fp32_tile_min_rows()` rows on CPUs whose bf16 GEMMs run in software, fp32 tiles of the weight
  (AVX2-only CPUs, where oneDNN has no bf16 path and keeps no packed copy: from 2 rows).
fp32 weights and other devices use `F.linear`. Quantized kernels (int8 / int4 / GGUF) belong
beside this module.
"""

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels.activation import silu_and_mul
from minivllm.model_executor.kernels.op_library import register_op


# Rows of bf16 x from which CPUs without bf16 matrix instructions (`ops.bf16_gemm_in_software`)
# multiply in fp32: x widened, the weight widened one tile of `FP32_TILE_ELEMS` at a time, one
# rounding of the result. On the 2-core Ice Lake box, the default model's linears at 64-256 rows:
# 2.0-3.0x oneDNN's packed bf16 GEMM (the 49152-row LM head: 0.8x at 64, 1.8x at 256; prompt
# steps give it a row per sequence only). Below 64 rows the gain was 1.3-1.5x at best.
FP32_TILE_MIN_ROWS = 64
FP32_TILE_ELEMS = 1 << 20        # 4 MB of fp32 weight per tile
# Rows from which bf16 linears multiply fp32 tiles where oneDNN has no bf16 path (`onednn_bf16`
# false): torch's own bf16 GEMM ran at 12-18 GFLOP/s on the 2-core Zen 3 box at every row count,
# fp32 tiles at 27-37 from 8 rows and 90-130 from 64 (about even with it at 1 row).
NO_ONEDNN_FP32_ROWS = 2


def fp32_tiles(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               widen: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.float,
               row_multiple: int = 1) -> torch.Tensor:
    """x [T, in] (bf16 / fp16) @ W^T (+ bias) in fp32, rounded once to x.dtype. `widen` maps a
    slice of rows of `weight` (tiles start at multiples of `row_multiple`) to their fp32 values
    (GGUF blocks: dequantisation), so the whole weight is never widened at once."""
    xf = x.float()
    tile = max(16, FP32_TILE_ELEMS // x.shape[1]) // row_multiple * row_multiple
    n = weight.shape[0]
    parts = [F.linear(xf, widen(weight[n0:n0 + tile])) for n0 in range(0, n, tile)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack_for_cpu(layer: nn.Module) -> None:
    """Keep a oneDNN-blocked copy of a bf16 CPU weight: its GEMMs run ~2x faster at batch 1
    and ~1.3x at batch 64 than `F.linear` on the plain layout (measured on the 2-core CI box).

    The copy hangs on the weight itself (`weight._mkldnn_packed`), so `cpu_linear` finds it from
    the plain weight alone, also inside compiled graphs (which cannot hold oneDNN tensors).
    NOTE: the copy is taken once after loading; code that rewrites `weight` later must call
    this again. fp32 and other devices keep the plain `F.linear` path (and its exact numerics).
    """
    weight = getattr(layer, "weight", None)
    if weight is None:
        return
    weight._mkldnn_packed = None
    weight._cpu_bf16 = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
    weight._gemv_ok, weight._amx_rows, weight._fp32_rows = False, 0, 1 << 62
    # A layer may reshape its weight for another op (MambaMixer2's conv1d holds [C, 1, K]).
    if not weight._cpu_bf16 or weight.dim() != 2:
        return
    if onednn_bf16():
        weight._mkldnn_packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    # Checked once here rather than per call: one-token steps call ~120 linears each.
    weight._gemv_ok = ops.gemv_supports_weight(weight)
    weight._amx_rows = ops.gemm_rows(weight)
    weight._fp32_rows = fp32_tile_min_rows()


def fp32_tile_min_rows() -> int:
    """Rows of bf16 x from which linears on this CPU multiply fp32 tiles (`fp32_tiles`):
    `NO_ONEDNN_FP32_ROWS` where oneDNN has no bf16 path, `FP32_TILE_MIN_ROWS` where its bf16
    GEMMs run in software, else never (1 << 62)."""
    if not onednn_bf16():
        return NO_ONEDNN_FP32_ROWS
    return FP32_TILE_MIN_ROWS if ops.bf16_gemm_in_software() else 1 << 62


def onednn_bf16() -> bool:
    """True when oneDNN runs bf16 matmuls on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); on
    AVX2-only CPUs (Zen 3, client Intel before Alder Lake) it refuses them, and torch's own bf16
    GEMM is what `F.linear` gets."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` for x [T, in]. bf16 on CPU: up to `weight._amx_rows` rows (decode steps, bound
    by streaming the weight once; prompt chunks of up to 1024 rows for a weight that fits L2)
    through the native AMX GEMM, else up to 8 rows through the native GEMV; more (prefill)
    through oneDNN's packed copy of `weight` (fp32 tiles where bf16 GEMMs run in software)."""
    if getattr(weight, "_cpu_bf16", False) and x.dtype == torch.bfloat16 and x.dim() == 2:
        rows = x.shape[0]
        if 0 < rows <= weight._amx_rows:
            return ops.gemm_bf16(x, weight, bias)
        if rows <= ops.GEMV_MAX_ROWS and weight._gemv_ok:
            return ops.gemv_bf16(x, weight, bias)
        if rows >= weight._fp32_rows:
            return fp32_tiles(x, weight, bias)
        packed = weight._mkldnn_packed
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _cpu_linear_fake(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# `torch.ops.minivllm.cpu_linear`: `cpu_linear` as an op compiled graphs call (they pass the
# plain weight parameter).
register_op("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", cpu_linear,
            _cpu_linear_fake)


def cpu_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """SiluAndMul of `cpu_linear(x, weight, bias)` for a gate_up weight [2d, in] (what the fusion
    pass puts in place of the pair): bf16 inputs the AMX GEMM takes in one native call, which
    applies the activation to each output block while it is in registers; others in two steps."""
    if (0 < x.shape[0] <= getattr(weight, "_amx_rows", 0) and x.dtype == torch.bfloat16
            and x.dim() == 2 and weight.shape[0] % 32 == 0):
        return ops.gemm_silu_mul_bf16(x, weight, bias)
    return silu_and_mul(cpu_linear(x, weight, bias))


def _cpu_linear_silu_mul_fake(x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


register_op("cpu_linear_silu_mul(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
            cpu_linear_silu_mul, _cpu_linear_silu_mul_fake)


def dispatch_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ layer.weight^T + bias` for a plain weight: compiled graphs keep bf16 CPU linears as the
    opaque `cpu_linear` op (inductor must not lower them to its own GEMM); eager calls route
    directly."""
    weight = layer.weight
    if torch.compiler.is_compiling():
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
            return torch.ops.minivllm.cpu_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    return cpu_linear(x, weight, bias)
