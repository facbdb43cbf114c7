"""The GGUF kernel API: block shapes, the unsupported-type error, the pure-PyTorch dequantisers
(bit-exact to gguf-py, no native code), the fallback path without native kernels, embeddings,
and `torch.ops.minivllm.gguf_linear` eagerly and under torch.compile."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants

from minivllm.model_executor.kernels import gguf_linear as gl
from minivllm.model_executor.kernels.gguf_dequant import K_SCALE_OFFSETS, dequantize_torch

LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
K_HALVES = {T[name]: offsets for name, offsets in K_SCALE_OFFSETS.items()}


def random_weight(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: gguf-py's quantization (legacy types) or random valid blocks
    (K-quants: random quant bits, small random fp16 scales; gguf-py only dequantizes these)."""
    rng = np.random.default_rng(seed)
    if qtype in LEGACY:
        return quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    for at in K_HALVES[qtype]:
        half = (rng.standard_normal(raw.shape[:2]) * 2e-3).astype(np.float16)
        raw[..., at:at + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.fixture
def no_native(monkeypatch):
    """As on a machine without a compiler: every call takes the PyTorch paths."""
    monkeypatch.setattr(gl._Native, "resolved", True)
    monkeypatch.setattr(gl._Native, "lib", None)


def test_kernel_types_and_block_shapes():
    assert gl.GGUF_KERNEL_TYPES == frozenset(int(t) for t in LEGACY + K_QUANTS)
    assert gl.gguf_block_shape(T.Q4_1) == (32, 20)
    assert gl.gguf_block_shape(T.Q8_0) == (32, 34)
    assert gl.gguf_block_shape(T.Q6_K) == (256, 210)


def test_unsupported_type_error_names_type_tensor_and_choices():
    with pytest.raises(ValueError, match=r"IQ2_XS of tensor 'blk.0.attn_q.weight'.*Q4_K"):
        gl.check_gguf_type(T.IQ2_XS, "blk.0.attn_q.weight")
    with pytest.raises(ValueError, match="unknown type 999"):
        gl.check_gguf_type(999)
    with pytest.raises(ValueError, match="IQ4_NL"):
        gl.gguf_linear(torch.randn(1, 32), torch.zeros(4, 18, dtype=torch.uint8), T.IQ4_NL, None)
    for qtype in gl.GGUF_KERNEL_TYPES:
        gl.check_gguf_type(qtype)


@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=lambda t: T(t).name)
def test_torch_dequantizer_is_bit_exact(qtype):
    qw = random_weight(qtype, 9, 512)
    out = dequantize_torch(torch.from_numpy(qw), qtype)
    assert out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), quants.dequantize(qw, qtype))


def test_fallback_paths_without_native(no_native):
    qw = torch.from_numpy(random_weight(T.Q4_K, 24, 512))
    ref = torch.from_numpy(quants.dequantize(qw.numpy(), T.Q4_K))
    assert torch.equal(gl.gguf_dequantize(qw, T.Q4_K, torch.bfloat16), ref.bfloat16())
    x, b = torch.randn(3, 512), torch.randn(24)
    torch.testing.assert_close(gl.gguf_linear(x, qw, T.Q4_K, b), F.linear(x, ref, b))
    x3 = torch.randn(2, 3, 512)                                   # leading dims kept
    torch.testing.assert_close(gl.gguf_linear(x3, qw, T.Q4_K, None), F.linear(x3, ref))


def test_linear_reshapes_and_rejects_mismatched_shapes():
    qw = torch.from_numpy(random_weight(T.Q8_0, 16, 64))
    ref = torch.from_numpy(quants.dequantize(qw.numpy(), T.Q8_0))
    x3 = torch.randn(2, 3, 64)
    y = gl.gguf_linear(x3, qw, T.Q8_0, None)
    assert y.shape == (2, 3, 16)
    # int8 activations (native path): each element within amax / 254 (~0.01 here) per block
    torch.testing.assert_close(y, F.linear(x3, ref), atol=0.5, rtol=0.02)
    with pytest.raises(ValueError, match="Q8_0"):
        gl.gguf_linear(torch.randn(1, 96), qw, T.Q8_0, None)


def test_embedding_dequantizes_only_the_looked_up_rows():
    qw = torch.from_numpy(random_weight(T.Q8_0, 50, 64))
    ref = torch.from_numpy(quants.dequantize(qw.numpy(), T.Q8_0))
    ids = torch.tensor([3, 0, 49, 3])
    out = gl.gguf_embedding(ids, qw, T.Q8_0, torch.bfloat16)
    assert out.shape == (4, 64) and out.dtype == torch.bfloat16
    assert torch.equal(out, ref[ids].bfloat16())
    assert gl.gguf_embedding(ids.reshape(2, 2), qw, T.Q8_0, torch.float32).shape == (2, 2, 64)


def test_custom_op_eager_and_compiled():
    qw = torch.from_numpy(random_weight(T.Q4_1, 32, 128))
    ref = torch.from_numpy(quants.dequantize(qw.numpy(), T.Q4_1))
    x, b = torch.randn(2, 128), torch.randn(32)
    eager = torch.ops.minivllm.gguf_linear(x, qw, int(T.Q4_1), b)
    torch.testing.assert_close(eager, F.linear(x, ref, b), atol=0.5, rtol=0.02)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.minivllm.gguf_linear(x * 2, qw, int(T.Q4_1), b).relu()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), f(x))


@pytest.mark.requires_native
@pytest.mark.parametrize("rows", [1, 3, 9, 40])
def test_out_writes_into_a_column_slice(rows):
    # A fused layer of two types writes each product into its columns of one output (dot
    # kernel up to 4 rows, AMX strips or dequantised tiles beyond).
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    w = torch.from_numpy(random_weight(T.Q8_0, 48, 64, seed=rows))
    bias = torch.randn(48, generator=gen).bfloat16()
    full = torch.full((rows, 80), 7.0, dtype=torch.bfloat16)
    out = gl.gguf_linear(x, w, T.Q8_0, bias, out=full[:, 16:64])
    assert out.data_ptr() == full[:, 16:64].data_ptr()
    assert torch.equal(full[:, 16:64], gl.gguf_linear(x, w, T.Q8_0, bias))
    assert (full[:, :16] == 7).all() and (full[:, 64:] == 7).all()
    with pytest.raises(ValueError, match="out must be a"):
        gl.gguf_linear(x, w, T.Q8_0, None, out=full[:, :47])


def test_x8_layout_choice(monkeypatch):
    """MINIVLLM_GGUF_X8: auto and 1 give the x8 layout wherever its kernels are built, 0 the file
    layout; on AMX CPUs x8 weights still take the AMX strips above gguf_dot_max_rows rows (which
    read the layout), without AMX the int8 kernels take decode steps of any size."""
    monkeypatch.delenv("MINIVLLM_GGUF_X8", raising=False)
    assert gl._x8_wanted()
    monkeypatch.setenv("MINIVLLM_GGUF_X8", "1")
    assert gl._x8_wanted()
    monkeypatch.setenv("MINIVLLM_GGUF_X8", "0")
    assert not gl._x8_wanted()
    monkeypatch.setenv("MINIVLLM_GGUF_X8", "yes")
    with pytest.raises(ValueError, match="MINIVLLM_GGUF_X8 must be auto, 0 or 1, got 'yes'"):
        gl._x8_wanted()
    for name, value in (("resolved", True), ("amx", True), ("int8_decode", True)):
        monkeypatch.setattr(gl._Native, name, value)
    for x8 in (False, True):
        monkeypatch.setattr(gl._Native, "x8", x8)
        assert gl.gguf_int8_max_rows(independent_rows=True) == gl.GGUF_DOT_MAX_ROWS
    # x8 weights keep the dot kernels for more rows there, by K; the file layout for 4
    x8_q4_1 = T.Q4_1 | gl.GGUF_X8_LAYOUT
    assert [gl.gguf_dot_max_rows(x8_q4_1, k) for k in (576, 1023, 1024, 4096)] == [8, 8, 16, 16]
    assert gl.gguf_dot_max_rows(T.Q4_1, 4096) == gl.GGUF_DOT_MAX_ROWS
    monkeypatch.setattr(gl._Native, "amx", False)
    assert gl.gguf_dot_max_rows(x8_q4_1, 4096) == gl.GGUF_DOT_MAX_ROWS
    assert gl.gguf_int8_max_rows(independent_rows=True) == gl.GGUF_TILE_MAX_ROWS


@pytest.mark.requires_native
def test_few_prompt_rows_see_the_weights_as_a_whole_prompt_does():
    """A step with prompt tokens never quantizes x to int8, however few rows it brings (a
    prompt's tail recomputed after a prefix-cache hit): each row equals that row of the whole
    prompt's product; a decode step of the same rows takes the int8 kernels."""
    from minivllm.forward_context import BatchDescriptor, ForwardContext, override_forward_context

    def step(tokens: int, reqs: int):
        return override_forward_context(ForwardContext(
            no_compile_layers={}, attn_metadata=None,
            batch_descriptor=BatchDescriptor(tokens, reqs, uniform=tokens == reqs)))

    qw = torch.from_numpy(random_weight(T.Q4_1, 64, 256))
    x = torch.randn(gl.GGUF_DOT_MAX_ROWS + 32, 256).bfloat16()
    with step(x.shape[0], 1):
        whole = gl.gguf_linear(x, qw, T.Q4_1, None)
    tail = x[-gl.GGUF_DOT_MAX_ROWS:]
    with step(tail.shape[0], 1):
        assert torch.equal(gl.gguf_linear(tail, qw, T.Q4_1, None), whole[-tail.shape[0]:])
    with step(tail.shape[0], tail.shape[0]):                   # decode rows: int8 x
        assert not torch.equal(gl.gguf_linear(tail, qw, T.Q4_1, None), whole[-tail.shape[0]:])
