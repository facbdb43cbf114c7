"""Matmuls with 8-bit weights (fp8 e4m3, int8) in plain PyTorch, tuned for CPU; the quant methods'
kernels (fp8, compressed-tensors, online int8).

Measured on the shared 2-core AVX-512/AMX box, one thread, a [3072, 576] weight, bf16 x:

| path                                   | M=1    | M=64   |
|----------------------------------------|--------|--------|
| bf16 F.linear / oneDNN packed (ref.)   | 0.8 / 0.45 ms | 1.6 / 1.0 ms |
| fp8: torch's fp8 -> bf16 cast + linear | 32 ms  | 35 ms  |
| fp8: `torch._scaled_mm` (W8A8)         | 40 ms  | seconds |
| fp8: bit-trick tiles (W8A16 / W8A8)    | 4.5 / 5.0 ms | 6.5 / 6.9 ms |
| int8: `_weight_int8pack_mm` / widened  | 0.44 / 1.5 ms | 10.6 / 3.5 ms |

torch 2.13's fp8 -> wider casts on CPU are scalar (~25 ns per element), so fp8 weights are widened
with integer ops (`fp8_e4m3_to_bf16`, exact) one row tile at a time; `_weight_int8pack_mm` wins
up to a few rows (`_INT8PACK_MAX_ROWS`), widening beyond.
No dequantised copy of a weight outlives a call: tiles are at most `_TILE_ELEMS` elements.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite e4m3fn value
INT8_MAX = 127.0
# Dequantised weight tiles stay around L2 size (2 MiB in bf16) and bound the transient memory.
_TILE_ELEMS = 1 << 20
# Up to this many rows `_weight_int8pack_mm` wins over widening the int8 weight (see above).
_INT8PACK_MAX_ROWS = 4
# e4m3 bits placed in a bf16's exponent/mantissa read as value * 2^-120 (bias 7 vs 127).
_BF16_REBIAS = 2.0 ** 120


def fp8_e4m3_to_bf16(weight: torch.Tensor) -> torch.Tensor:
    """Exact e4m3fn -> bf16 (any shape). On CPU: sign-extend the byte to int16, shift the
    exponent and mantissa into bf16's fields, keep the sign bit; that reads as value * 2^-120,
    which one multiply by 2^120 (exact, a power of two) undoes. Subnormals stay exact too."""
    if weight.device.type != "cpu":
        return weight.to(torch.bfloat16)
    bits = weight.view(torch.int8).to(torch.int16)
    bits.bitwise_left_shift_(4).bitwise_and_(0x87F0)     # sign | 4 exponent | 3 mantissa bits
    return bits.view(torch.bfloat16).mul_(_BF16_REBIAS)


def fp8_to_dtype(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The exact fp8 values in `dtype` (bf16 / fp16 / fp32 hold every e4m3 value)."""
    widened = fp8_e4m3_to_bf16(weight)
    return widened if dtype == torch.bfloat16 else widened.to(dtype)


def scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor | None = None,
                     use_per_token_if_dynamic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x / scale as e4m3 [M, K], scale fp32). A given `scale` is static; None makes
    it dynamic: one for the tensor ([1]) or, per token, one per row ([M, 1])."""
    if scale is None:
        amax = (x.abs().amax(dim=-1, keepdim=True) if use_per_token_if_dynamic
                else x.abs().amax().reshape(1))
        scale = (amax.float() / FP8_MAX).clamp_(min=1e-12)
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.float()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, input_scale: torch.Tensor | None = None,
               quantize_input: bool = False, per_token: bool = False) -> torch.Tensor:
    """`y = x W^T * scales + b` for an e4m3 weight [N, K] with a per-tensor ([1]) or per-channel
    ([N]) fp32 `weight_scale`. With `quantize_input` (W8A8, vLLM's fp8 semantics) x is first
    rounded to e4m3 with `input_scale` (static) or a dynamic per-tensor / per-token scale. In
    bf16 both operands then hold exact fp8 values and every scale is applied once, to the
    output; fp16 cannot hold those unscaled sums (448 * |x| * K), so there the operands are
    scaled first."""
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)                                          # [M, K]
    if x2.shape[0] == 0:                                           # no rows: nothing to scale by
        return x.new_empty(*x.shape[:-1], n)
    scale_first = x.dtype == torch.float16
    scale = weight_scale.float().reshape(-1).expand(n)             # [N]
    x_scale = None
    if quantize_input:
        xq, x_scale = scaled_fp8_quant(x2, input_scale, per_token)  # x_scale [1] or [M, 1]
        x2 = ((fp8_to_dtype(xq, torch.float32) * x_scale).to(x.dtype) if scale_first
              else fp8_to_dtype(xq, x.dtype))
    if scale_first:
        out = _matmul_tiles(x2, weight, fp8_to_dtype, scale)
    else:
        out = _matmul_tiles(x2, weight, fp8_to_dtype).mul_(scale)  # [M, N]
        if x_scale is not None:
            out.mul_(x_scale.reshape(-1, 1))
    if bias is not None:
        out.add_(bias)
    return out.reshape(*x.shape[:-1], n)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block_size: list[int], bias: torch.Tensor | None = None, *,
                     quantize_input: bool = True) -> torch.Tensor:
    """Block-wise fp8 (DeepSeek style): `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] scales each
    [bn, bk] block. Activations get vLLM's dynamic per-token-group (1 x bk) fp8 rounding."""
    block_n, block_k = block_size
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    if quantize_input:
        x2 = _fake_quant_fp8_groups(x2, block_k)
    rows = max(block_n, (_TILE_ELEMS // k) // block_n * block_n)   # tiles start on block rows
    out = x2.new_empty(x2.shape[0], n)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        scales = weight_scale_inv[start // block_n:(stop + block_n - 1) // block_n].float()
        scales = scales.repeat_interleave(block_n, 0)[:stop - start]
        scales = scales.repeat_interleave(block_k, 1)[:, :k]               # [rows, K]
        tile = fp8_to_dtype(weight[start:stop], torch.float32).mul_(scales).to(x.dtype)
        out[:, start:stop] = F.linear(x2, tile)
    if bias is not None:
        out.add_(bias)
    return out.reshape(*x.shape[:-1], n)


def per_tensor_fp8_quant(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online fp8: (e4m3 weight, fp32 scale [1]) with the scale `max|W| / 448`."""
    scale = (weight.abs().amax().float() / FP8_MAX).clamp_(min=1e-12).reshape(1)
    return _quantize_rows(weight, scale.reshape(1, 1), FP8_DTYPE, FP8_MAX), scale


def per_channel_fp8_quant(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online fp8, per output channel: (e4m3 weight [N, K], fp32 scale [N])."""
    scale = (weight.abs().amax(dim=1).float() / FP8_MAX).clamp_(min=1e-12)
    return _quantize_rows(weight, scale.reshape(-1, 1), FP8_DTYPE, FP8_MAX), scale


def per_channel_int8_quant(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel int8: (int8 [N, K], fp32 scale [N]). Each scale is rounded UP to a
    bf16 value, so the bf16 kernel's scales are exact and no value clips."""
    scale = (weight.abs().amax(dim=1).float() / INT8_MAX).clamp_(min=1e-8)
    rounded = scale.to(torch.bfloat16).float()
    low = rounded < scale
    # one bf16 ulp up: bf16 is the top half of an fp32, so its ulp is bit 16 (scales are > 0)
    rounded[low] = (rounded[low].view(torch.int32) + (1 << 16)).view(torch.float32)
    return _quantize_rows(weight, rounded.reshape(-1, 1), torch.int8, INT8_MAX), rounded


def scaled_int8_quant(x: torch.Tensor,
                      scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 activations x [M, K] -> (int8 [M, K], fp32 scale): a given per-tensor
    scale (static), else dynamic per token ([M, 1])."""
    if scale is None:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() / INT8_MAX).clamp_(min=1e-10)
    q = torch.round(x.float() / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.float()


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, *, input_scale: torch.Tensor | None = None,
                quantize_input: bool = False) -> torch.Tensor:
    """`y = x W^T * scale + b` for an int8 weight [N, K] with fp32 per-channel scales [N] (or [1]).
    With `quantize_input` (W8A8) x is rounded to int8 per token (or with the static
    `input_scale`) and fed as exact integers; the activation scale is applied to the output."""
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)                                          # [M, K]
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n)
    scale_first = x.dtype == torch.float16            # as in fp8_linear: fp16 sums overflow
    x_scale = None
    if quantize_input:
        xq, x_scale = scaled_int8_quant(x2, input_scale)
        if scale_first:
            x2, x_scale = (xq.float() * x_scale).to(x.dtype), None
        else:
            x2 = xq.to(x.dtype)                                    # |q| <= 127: exact in bf16
    scale = weight_scale.float().reshape(-1).expand(n)             # [N]
    if (x2.device.type == "cpu" and x2.shape[0] <= _INT8PACK_MAX_ROWS
            and x2.dtype in (torch.bfloat16, torch.float16)):
        # the kernel scales its fp32 sums before rounding to x's dtype
        out = torch._weight_int8pack_mm(x2.contiguous(), weight, scale.to(x2.dtype))
    elif scale_first:
        out = _matmul_tiles(x2, weight, _int8_to_dtype, scale)
    else:
        out = _matmul_tiles(x2, weight, _int8_to_dtype).mul_(scale)
    if x_scale is not None:
        out.mul_(x_scale.reshape(-1, 1))
    if bias is not None:
        out.add_(bias)
    return out.reshape(*x.shape[:-1], n)


def _int8_to_dtype(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(dtype)


def _matmul_tiles(x: torch.Tensor, weight: torch.Tensor,
                  widen: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
                  row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ widen(weight [N, K])^T one row tile at a time: the exact 8-bit values, or with
    `row_scale` [N] (fp32) the scaled ones, rounded once to x's dtype."""
    n, k = weight.shape
    rows = min(n, max(1, _TILE_ELEMS // k))
    out = x.new_empty(x.shape[0], n) if rows < n else None
    for start in range(0, n, rows):
        if row_scale is None:
            tile = widen(weight[start:start + rows], x.dtype)
        else:
            tile = widen(weight[start:start + rows], torch.float32)
            tile = tile.mul_(row_scale[start:start + rows, None]).to(x.dtype)
        if out is None:
            return F.linear(x, tile)
        out[:, start:start + rows] = F.linear(x, tile)
    return out


def fp8_quant_groups(x: torch.Tensor, group: int,
                     eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, ceil(K/g), g], fp32 scales [M, ceil(K/g), 1]): one dynamic scale
    per (token, group of `group` columns); a last partial group is zero-padded."""
    m, k = x.shape
    padded = F.pad(x.float(), (0, (-k) % group)).reshape(m, -1, group)   # [M, K/g, g]
    scale = (padded.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=eps)
    return (padded / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _fake_quant_fp8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] rounded to e4m3 with one dynamic scale per (token, group of `group` columns)."""
    m, k = x.shape
    q, scale = fp8_quant_groups(x, group)
    return (fp8_to_dtype(q, torch.float32) * scale).reshape(m, -1)[:, :k].to(x.dtype)


def _quantize_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   qmax: float) -> torch.Tensor:
    """weight / scale rounded to `dtype` (fp8 rounds itself; int8 via round-half-even), a row
    tile at a time so that no fp32 copy of a large weight is made. scale: [1, 1] or [N, 1]."""
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    rows = max(1, _TILE_ELEMS // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        tile_scale = scale if scale.shape[0] == 1 else scale[start:start + rows]
        tile = weight[start:start + rows].float() / tile_scale
        if dtype == torch.int8:
            tile = torch.round(tile)
        out[start:start + rows] = tile.clamp_(-qmax, qmax).to(dtype)
    return out
