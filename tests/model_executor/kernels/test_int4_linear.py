"""The int4 weight-only linear: both layouts, both paths (int4pack kernel, dequantised tiles)."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.kernels import int4_linear as int4
from minivllm.model_executor.kernels.int4_linear import (dequantize_int4, int4_linear,
                                                         pack_int4, uses_int4pack)


def _random_int4(num_out: int, num_in: int, group_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (num_out, num_in), generator=gen)
    groups = num_in // group_size
    scales = torch.rand(num_out, groups, generator=gen) * 0.02 + 0.005
    zero_points = torch.randint(0, 16, (num_out, groups), generator=gen).float()
    # [N, K] fp32 reference weight: (q - zp) * s, group by group
    weight = (codes.float() - zero_points.repeat_interleave(group_size, 1)) \
        * scales.repeat_interleave(group_size, 1)
    return codes, scales, zero_points, weight


def _bf16_bound(weight: torch.Tensor, x: torch.Tensor) -> float:
    """|x| @ |W|^T times ~3 bf16 roundings (the scale, the offset, the dequantised value or the
    kernel's product): the error allowed against the fp32 reference."""
    return float((x.float().abs() @ weight.abs().t()).max()) * 3 * 2.0 ** -8


def test_int4pack_layout_is_the_one_the_dequantiser_reads():
    block = int4._int4pack_block_rows()
    # torch packs 64-row blocks with AVX-512, 32-row ones on AVX2-only CPUs
    assert block == (64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32)
    # With s = 1 and zp = 0, dequantising returns the codes themselves, row for row.
    for num_out in (64, 128, 48, 32):
        codes = torch.randint(0, 16, (num_out, 96))
        packed, sz, group = pack_int4(codes, torch.ones(num_out, 3), torch.zeros(num_out, 3), 32,
                                      torch.float32)
        assert packed.shape == (num_out, 48) and packed.dtype == torch.uint8
        assert uses_int4pack(packed.device, num_out) == (num_out % block == 0)
        assert torch.equal(dequantize_int4(packed, sz, group), codes.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, 80])            # int4pack kernel twice, dequant tiles
@pytest.mark.parametrize("num_out", [128, 48])          # int4pack layout, plain layout
def test_int4_linear_matches_the_dequantised_matmul(group_size: int, rows: int, num_out: int,
                                                    dtype: torch.dtype):
    codes, scales, zero_points, weight = _random_int4(num_out, 256, group_size)
    packed, sz, group = pack_int4(codes, scales, zero_points, group_size, dtype)
    x = torch.randn(rows, 256, dtype=dtype)
    out = int4_linear(x, packed, sz, group)
    assert out.dtype == dtype and out.shape == (rows, num_out)
    ref = x.float() @ weight.t()
    assert (out.float() - ref).abs().max() <= _bf16_bound(weight, x)


def test_both_paths_agree_and_tiles_cover_every_row(monkeypatch):
    codes, scales, zero_points, weight = _random_int4(640, 128, 64)
    packed, sz, group = pack_int4(codes, scales, zero_points, 64, torch.float32)
    x = torch.randn(3, 128)
    by_kernel = int4_linear(x, packed, sz, group)
    monkeypatch.setattr(int4, "INT4PACK_MAX_ROWS", 0)
    monkeypatch.setattr(int4, "_TILE_ELEMENTS", 128 * 128)   # 128-row tiles: 5 of them
    by_tiles = int4_linear(x, packed, sz, group)
    torch.testing.assert_close(by_tiles, x @ weight.t(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(by_kernel, by_tiles, atol=1e-4, rtol=1e-4)


def test_per_channel_scales_bias_perm_and_leading_dims():
    # group = K (per channel: GPTQ's group_size -1) runs as kernel groups of 64 with the
    # scale repeated; perm reorders x's columns before the matmul.
    codes, scales, zero_points, weight = _random_int4(64, 192, 192)
    packed, sz, group = pack_int4(codes, scales, zero_points, 192, torch.float32)
    assert group == 64 and sz.shape == (3, 64, 2)
    perm = torch.randperm(192)
    bias = torch.randn(64)
    x = torch.randn(2, 3, 192)
    out = int4_linear(x, packed, sz, group, bias, perm)
    ref = F.linear(x[..., perm], weight, bias)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_unsupported_group_sizes_name_the_supported_ones():
    codes = torch.zeros(64, 96, dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple of 32.*32, 64, 128, 256"):
        pack_int4(codes, torch.ones(64, 6), torch.zeros(64, 6), 16, torch.float32)
    with pytest.raises(ValueError, match="input size 96 is not a multiple of the group size 64"):
        pack_int4(codes, torch.ones(64, 1), torch.zeros(64, 1), 64, torch.float32)


def test_compiled_graph_keeps_the_op_opaque():
    codes, scales, zero_points, weight = _random_int4(64, 64, 32)
    packed, sz, group = pack_int4(codes, scales, zero_points, 32, torch.float32)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, packed, sz, group).relu()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (1, 7):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x), fn(x))
