"""Weight-only int4 linears (AWQ, GPTQ, online int4): one packed form, one matmul.

Every int4 method converts its checkpoint tensors once after loading (`pack_int4`) into
- `packed` uint8 `[N, K/2]`: two 4-bit codes q in [0, 16) per byte, N = out, K = in;
- `scales_and_zeros` `[K/g, N, 2]` in the activation dtype: per group a scale s and a float
  offset z, so that the weight is `W[n, k] = (q[n, k] - 8) * s + z` (the layout and the
  convention of torch's `_weight_int4pack_mm_for_cpu`). A format's integer zero point zp
  (`W = (q - zp) * s`) becomes `z = (8 - zp) * s`.
`int4_linear(x, packed, scales_and_zeros, group_size)` then computes `x @ W^T`:
- on CPU, for N % B == 0, `packed` is torch's int4pack layout (blocks of B = 64 rows on AVX-512
  CPUs, 32 on AVX2 ones; row i and row i + B/2 in one byte) and up to `INT4PACK_MAX_ROWS` rows
  of x go through `_weight_int4pack_mm_for_cpu`, which streams 4-bit weights (decode is bound by weight bytes);
- more rows (prompts), other devices and other N dequantise the weight tile by tile in torch
  and run a dense matmul (the int4pack kernel's cost grows about linearly with the rows).
No dequantised copy of the weight is kept: only one tile lives at a time.
"""

import functools

import torch
import torch.nn.functional as F

from minivllm.model_executor.kernels.op_library import register_op

# Group sizes the int4pack kernel takes; a larger format group (or per-channel) is expressed with
# the largest of these that divides it, its scale repeated.
KERNEL_GROUP_SIZES = (256, 128, 64, 32)
# Rows up to which the int4pack kernel beats dequantise + dense matmul. Measured for a
# [3072, 576] weight, one thread: the kernel takes ~120 us at M=1 (bf16: ~160 us through the AMX
# GEMM, ~270 us through F.linear) and grows ~50 us per row; dequantising tiles in torch costs
# ~3.5 ms whatever M: they cross near 64 rows. (Both lose to the bf16 AMX GEMM beyond ~2 rows:
# prompts want a native dequantise-into-AMX kernel.)
INT4PACK_MAX_ROWS = 64
# Weight elements dequantised at once: a [~448, 576] fp32 tile (1 MiB) stays in L2.
_TILE_ELEMENTS = 1 << 18


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
              group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pack `codes` [N, K] (ints in [0, 16)) with per-group `scales` and `zero_points`
    [N, K/group_size] (`W = (q - zp) * s`) for `int4_linear`.

    Returns (packed uint8 [N, K/2], scales_and_zeros [K/kg, N, 2] in `dtype`, kg), kg being the
    kernel's group size (`group_size` or a divisor of it from `KERNEL_GROUP_SIZES`).
    """
    num_out, num_in = codes.shape
    kernel_group = kernel_group_size(group_size, num_in)
    repeat = group_size // kernel_group
    # [N, K/g] -> [N, K/kg]: each scale covers `repeat` kernel groups
    scales = scales.float().repeat_interleave(repeat, dim=1)
    zeros = (8.0 - zero_points.float().repeat_interleave(repeat, dim=1)) * scales
    # [K/kg, N, 2]
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)
    # NOTE: contiguous before widening: callers pass transposed uint8 codes, and a 4-byte copy
    # of a big layer is the load-time peak.
    codes = codes.contiguous()
    if uses_int4pack(codes.device, num_out):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    else:
        # plain layout: byte j of row n holds q[n, 2j] (low nibble) and q[n, 2j + 1]
        pairs = codes.view(num_out, num_in // 2, 2).to(torch.uint8)
        packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.view(num_out, num_in // 2), scales_and_zeros, kernel_group


def kernel_group_size(group_size: int, num_in: int) -> int:
    """The kernel group for a format group `group_size` over `num_in` input columns."""
    if num_in % group_size != 0:
        raise ValueError(f"The input size {num_in} is not a multiple of the group size "
                         f"{group_size}")
    for candidate in KERNEL_GROUP_SIZES:
        if group_size % candidate == 0:
            return candidate
    raise ValueError(f"Group size {group_size} is not a multiple of 32; the int4 kernel takes "
                     f"groups of {', '.join(map(str, sorted(KERNEL_GROUP_SIZES)))}")


def uses_int4pack(device: torch.device, num_out: int) -> bool:
    """Whether weights with `num_out` rows on `device` take torch's int4pack layout."""
    block = _int4pack_block_rows()
    return torch.device(device).type == "cpu" and block > 0 and num_out % block == 0


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None,
                perm: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T + bias` for x [..., K] and the packed int4 W [N, K] (see `pack_int4`).

    `perm` [K] (GPTQ act-order) reorders x's columns first, so that the groups are contiguous.
    """
    if torch.compiler.is_compiling():
        # An opaque op: inductor must not trace the dispatch on the row count.
        return torch.ops.minivllm.int4_linear(x, packed, scales_and_zeros, group_size, bias, perm)
    return _int4_linear_impl(x, packed, scales_and_zeros, group_size, bias, perm)


def dequantize_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """The whole weight [N, K] in the scales' dtype (tests and `dequantize_weight`)."""
    return _dequantize_rows(packed, scales_and_zeros, group_size, 0, packed.shape[0])


def _int4_linear_impl(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                      group_size: int, bias: torch.Tensor | None,
                      perm: torch.Tensor | None) -> torch.Tensor:
    lead_shape = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                    # [M, K]
    if perm is not None:
        x2 = x2.index_select(1, perm)
    num_out = packed.shape[0]
    x2 = x2.to(scales_and_zeros.dtype)
    if x2.shape[0] <= INT4PACK_MAX_ROWS and uses_int4pack(packed.device, num_out):
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), packed, group_size,
                                                         scales_and_zeros)
    else:
        # NOTE: a loop over weight tiles (not tokens): each dequantised [tile, K] piece is used
        # while it is in cache, and the full dense weight never exists.
        block = _int4pack_block_rows() or 1
        step = max(block, _TILE_ELEMENTS // x2.shape[1] // block * block)
        tiles = [F.linear(x2, _dequantize_rows(packed, scales_and_zeros, group_size, start,
                                               min(step, num_out - start)))
                 for start in range(0, num_out, step)]
        out = torch.cat(tiles, dim=1) if len(tiles) > 1 else tiles[0]   # [M, N]
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).view(*lead_shape, num_out)


def _dequantize_rows(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                     start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of W as [rows, K] (start, rows multiples of the int4pack
    block for that layout)."""
    num_in = packed.shape[1] * 2
    tile = packed[start:start + rows]                  # [rows, K/2] uint8
    if uses_int4pack(packed.device, packed.shape[0]):
        # int4pack: each B-row block is [K, B/2] bytes; low nibble row i, high nibble row i + B/2
        b = _int4pack_block_rows()
        blocks = tile.reshape(rows // b, num_in, b // 2)
        nibbles = torch.stack((blocks & 15, blocks >> 4), dim=1)   # [rows/B, 2, K, B/2]
        codes = nibbles.transpose(2, 3).reshape(rows, num_in)
    else:
        codes = torch.stack((tile & 15, tile >> 4), dim=-1).reshape(rows, num_in)
    # [K/g, rows, 2] -> [rows, K/g, 1] each, in fp32: torch's eager bf16 arithmetic converts
    # per op anyway, and (q - 8) * s + z as q * s + (z - 8 s) saves one pass over the tile
    tile_sz = scales_and_zeros[:, start:start + rows].float().transpose(0, 1)
    scales = tile_sz[..., 0].unsqueeze(2).contiguous()   # contiguous: broadcasting is 3x faster
    offsets = (tile_sz[..., 1].unsqueeze(2) - 8.0 * scales).contiguous()
    weight = codes.view(rows, num_in // group_size, group_size).float()
    weight = weight.mul_(scales).add_(offsets)
    return weight.view(rows, num_in).to(scales_and_zeros.dtype)


@functools.cache
def _int4pack_block_rows() -> int:
    """Rows B per block of this torch build's int4pack layout, as `_dequantize_rows` reads it
    (checked once on a probe: torch packs 64 rows per block on AVX-512 CPUs, 32 on AVX2 ones);
    0 when neither matches: every weight then takes the plain layout and the dequantising path."""
    for block in (64, 32):
        try:
            codes = torch.randint(0, 16, (2 * block, 64), dtype=torch.int32,
                                  generator=torch.Generator().manual_seed(0))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        except (RuntimeError, AttributeError):
            return 0
        blocks = packed.reshape(2, 64, block // 2)
        nibbles = torch.stack((blocks & 15, blocks >> 4), dim=1).transpose(2, 3)
        if torch.equal(nibbles.reshape(codes.shape).to(torch.int32), codes):
            return block
    return 0


def _int4_linear_fake(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                      group_size: int, bias: torch.Tensor | None,
                      perm: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


register_op("int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, int group_size, "
            "Tensor? bias, Tensor? perm) -> Tensor", _int4_linear_impl, _int4_linear_fake)
