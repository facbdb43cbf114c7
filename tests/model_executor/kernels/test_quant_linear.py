"""8-bit matmul helpers against the dequantised fp32 reference: errors stay within the rounding
of the bf16 output (weight-only) or of the same 8-bit activation rounding (W8A8)."""

import pytest
import torch

from minivllm.model_executor.kernels import quant_linear as ql

N, K = 96, 80


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # one bf16 rounding of the output, plus one of the scale product: 2 * 2^-9 relative
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=2 ** -8 * ref.abs().max().item())


def test_fp8_to_bf16_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = codes.float()
    got = ql.fp8_e4m3_to_bf16(codes).float()
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(ql.fp8_to_dtype(codes, torch.float16).float()[finite], want[finite])


@pytest.fixture
def fp8_weight():
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
    return ql.per_channel_fp8_quant(w)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("act", ["weight_only", "dynamic_tensor", "dynamic_token", "static"])
def test_fp8_linear_matches_reference(fp8_weight, rows, act):
    wq, scale = fp8_weight
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bias = torch.randn(N).to(torch.bfloat16)
    xf = x.float()
    kwargs = {}
    if act != "weight_only":
        s = {"dynamic_tensor": xf.abs().amax() / 448, "dynamic_token": xf.abs().amax(1, keepdim=True) / 448,
             "static": torch.tensor(0.01)}[act]
        xf = (xf / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
        kwargs = dict(quantize_input=True, per_token=act == "dynamic_token",
                      input_scale=torch.tensor([0.01]) if act == "static" else None)
    ref = xf @ (wq.float() * scale[:, None]).t() + bias.float()
    _close(ql.fp8_linear(x, wq, scale, bias, **kwargs), ref)
    # per-tensor scale and a 3-d input
    per_tensor = scale.max().reshape(1)
    ref_t = (xf @ (wq.float() * per_tensor).t()).reshape(1, rows, N)
    _close(ql.fp8_linear(x.reshape(1, rows, K), wq, per_tensor, **kwargs), ref_t)


def test_fp8_row_tiles_equal_one_tile(fp8_weight, monkeypatch):
    wq, scale = fp8_weight
    x = torch.randn(5, K).to(torch.bfloat16)
    whole = ql.fp8_linear(x, wq, scale)
    monkeypatch.setattr(ql, "_TILE_ELEMS", 10 * K)            # 10-row tiles, a ragged last one
    assert torch.equal(ql.fp8_linear(x, wq, scale), whole)


def test_fp8_block_linear_matches_reference():
    gen = torch.Generator().manual_seed(2)
    n, k, b = 96, 80, 32                                   # ragged blocks on both dims
    wq = torch.randn(n, k, generator=gen).clamp(-4, 4).to(torch.float8_e4m3fn)
    s = torch.rand(3, 3, generator=gen) + 0.5
    deq = wq.float() * s.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
    x = torch.randn(4, k, generator=gen).to(torch.bfloat16)
    _close(ql.fp8_block_linear(x, wq, s, [b, b], quantize_input=False), x.float() @ deq.t())
    # with per-token-group activation rounding
    xf = torch.nn.functional.pad(x.float(), (0, 16)).reshape(4, 3, b)
    xs = xf.abs().amax(-1, keepdim=True) / 448
    xq = ((xf / xs).to(torch.float8_e4m3fn).float() * xs).reshape(4, 96)[:, :k]
    _close(ql.fp8_block_linear(x, wq, s, [b, b]), xq @ deq.t())


def test_per_channel_int8_quant():
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(3))
    q, scale = ql.per_channel_int8_quant(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(scale.to(torch.bfloat16).float(), scale)        # exact in bf16
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 4, 5, 64], ids=lambda r: f"M{r}")   # int8pack up to 4 rows
@pytest.mark.parametrize("act", ["weight_only", "dynamic_token", "static"])
def test_int8_linear_matches_reference(rows, act):
    gen = torch.Generator().manual_seed(4)
    q, scale = ql.per_channel_int8_quant(torch.randn(N, K, generator=gen))
    x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
    xf, kwargs = x.float(), {}
    if act != "weight_only":
        s = xf.abs().amax(1, keepdim=True) / 127 if act == "dynamic_token" else torch.tensor(0.03)
        xf = torch.round(xf / s).clamp(-127, 127) * s
        kwargs = dict(quantize_input=True,
                      input_scale=torch.tensor([0.03]) if act == "static" else None)
    ref = xf @ (q.float() * scale[:, None]).t()
    _close(ql.int8_linear(x, q, scale, **kwargs), ref)


def test_int8_linear_float32():
    q, scale = ql.per_channel_int8_quant(torch.randn(N, K))
    x = torch.randn(3, K)
    torch.testing.assert_close(ql.int8_linear(x, q, scale), x @ (q.float() * scale[:, None]).t(),
                               rtol=1e-5, atol=1e-5)


def test_no_rows():
    wq, scale = ql.per_tensor_fp8_quant(torch.randn(N, K))
    q, s = ql.per_channel_int8_quant(torch.randn(N, K))
    x = torch.empty(0, K, dtype=torch.bfloat16)
    assert ql.fp8_linear(x, wq, scale, quantize_input=True).shape == (0, N)
    assert ql.fp8_block_linear(x, wq, torch.ones(3, 3), [32, 32]).shape == (0, N)
    assert ql.int8_linear(x, q, s, quantize_input=True).shape == (0, N)


@pytest.mark.parametrize("rows", [1, 64])
def test_fp16_activations_do_not_overflow(rows):
    """Unscaled 8-bit sums (448 * |x| * K for fp8, 127 * 127 * K for int8 W8A8) exceed fp16's
    65504: in fp16 the kernels scale the operands first."""
    k = 1024
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(N, k, generator=gen) * 0.02
    x = (torch.randn(rows, k, generator=gen) * 4).half()
    wq, ws = ql.per_channel_fp8_quant(w)
    for kwargs in ({}, dict(quantize_input=True)):
        out = ql.fp8_linear(x, wq, ws, **kwargs)
        assert out.dtype == torch.float16 and out.isfinite().all()
        xf = x.float()
        if kwargs:
            s = xf.abs().amax() / 448
            xf = (xf / s).to(torch.float8_e4m3fn).float() * s
        _close(out, xf @ (wq.float() * ws[:, None]).t())
    q, s = ql.per_channel_int8_quant(w)
    for kwargs in ({}, dict(quantize_input=True)):
        out = ql.int8_linear(x, q, s, **kwargs)
        assert out.isfinite().all()
        xf = x.float()
        if kwargs:
            xs = xf.abs().amax(1, keepdim=True) / 127
            xf = torch.round(xf / xs) * xs
        _close(out, xf @ (q.float() * s[:, None]).t())
