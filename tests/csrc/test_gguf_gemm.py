"""The native GGUF kernels (csrc/gguf_gemm.cpp): dequantisation bit-exact to gguf-py, int8 dot
products within the bound their activation quantization implies, the AMX prompt path, row
slices, bias, dtypes, the portable (non-VNNI) build, and the default model's first layer."""

import ctypes
import functools
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T, GGUFReader, quants

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels.gguf_dequant import K_SCALE_OFFSETS
from minivllm.forward_context import BatchDescriptor, ForwardContext, override_forward_context
from minivllm.model_executor.kernels import cpu_linear, gguf_linear as gl

pytestmark = pytest.mark.requires_native

LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# offsets of the fp16 scale fields of each K-quant super-block (the other bytes: random bits)
K_HALVES = {T[name]: offsets for name, offsets in K_SCALE_OFFSETS.items()}


def random_weight(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: gguf-py's quantization of Gaussian values (legacy types), or
    random valid blocks (K-quants, which gguf-py cannot quantize): random quant bits, small
    random fp16 scales."""
    rng = np.random.default_rng(seed)
    if qtype in LEGACY:
        return quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
    elems, nbytes = gl.gguf_block_shape(qtype)
    raw = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    for at in K_HALVES[qtype]:
        half = (rng.standard_normal(raw.shape[:2]) * 2e-3).astype(np.float16)
        raw[..., at:at + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def dot_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N]: the most int8 activation quantization can move x @ w.T. Each 32-block of a row of
    x is rounded to a multiple of dx = amax / 127, so each element moves <= amax / 254 and an
    output <= sum over blocks of amax_b / 254 * sum_b |w|."""
    m, k = x.shape
    amax = x.float().abs().reshape(m, k // 32, 32).amax(-1)                  # [M, K/32]
    wsum = w.float().abs().reshape(w.shape[0], k // 32, 32).sum(-1)           # [N, K/32]
    return amax @ wsum.T / 254


def check_linear(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    # + fp32 summation slack, + one rounding of the output to x.dtype
    ulp = 2 ** -8 if x.dtype == torch.bfloat16 else 2 ** -20
    tol = dot_bound(x, w) * 1.01 + 1e-5 * ref.abs().amax() + ulp * ref.abs()
    assert y.shape == ref.shape and y.dtype == x.dtype
    excess = (y.float() - ref).abs() - tol
    assert excess.max() <= 0, f"max excess over the bound {excess.max().item():.3g}"


@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=lambda t: T(t).name)
def test_dequantize_is_bit_exact(qtype):
    cols = 512 if qtype in K_QUANTS else 544            # 17 legacy blocks: a ragged last unit
    qw = random_weight(qtype, 37, cols)
    ref = quants.dequantize(qw, qtype)
    out = gl.gguf_dequantize(torch.from_numpy(qw), qtype, torch.float32)
    np.testing.assert_array_equal(out.numpy(), ref)
    for dtype in (torch.bfloat16, torch.float16):
        got = gl.gguf_dequantize(torch.from_numpy(qw), qtype, dtype)
        assert got.dtype == dtype and torch.equal(got, torch.from_numpy(ref).to(dtype))


@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=lambda t: T(t).name)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 80])
def test_linear_within_activation_quantization_bound(qtype, m):
    cols = 512 if qtype in K_QUANTS else 608            # 19 legacy blocks
    qw = torch.from_numpy(random_weight(qtype, 96, cols, seed=m))
    w = torch.from_numpy(quants.dequantize(qw.numpy(), qtype))
    gen = torch.Generator().manual_seed(m)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, cols, generator=gen).to(dtype)
        bias = torch.randn(96, generator=gen).to(dtype)
        y = gl.gguf_linear(x, qw, qtype, bias)
        if dtype == torch.bfloat16 and m <= gl.gguf_int8_max_rows():
            check_linear(y, x, w, bias)           # int8 dot kernel, or x^T tiles from 16 rows
        else:   # dequantised tiles: weights in x's dtype (fp32 where bf16 GEMMs are software
                # and m >= FP32_TILE_MIN_ROWS), fp32 sums (no int8 step)
            wide = gl._Native.widen_prompts and m >= cpu_linear.FP32_TILE_MIN_ROWS
            ref = F.linear(x.float(), (w if wide else w.to(dtype)).float(), bias.float())
            torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=1e-2)


def test_fp16_x_and_empty_x():
    qw = torch.from_numpy(random_weight(T.Q4_0, 48, 256))
    w = torch.from_numpy(quants.dequantize(qw.numpy(), T.Q4_0))
    x, b = torch.randn(2, 256).half(), torch.randn(48).half()
    y = gl.gguf_linear(x, qw, T.Q4_0, b)
    ref = F.linear(x.float(), w, b.float())
    tol = dot_bound(x, w) * 1.01 + 1e-5 * ref.abs().amax() + 2 ** -11 * ref.abs()
    assert y.dtype == torch.float16 and ((y.float() - ref).abs() <= tol).all()
    assert gl.gguf_linear(torch.randn(0, 256), qw, T.Q4_0, None).shape == (0, 48)


def test_row_slices_strided_x_and_thread_count(monkeypatch):
    monkeypatch.setattr(gl, "GGUF_DOT_MAX_ROWS", 64)        # 13 rows: 8 + 4 + 1 at a time
    qw = torch.from_numpy(random_weight(T.Q4_1, 200, 576))
    w = torch.from_numpy(quants.dequantize(qw.numpy(), T.Q4_1))
    x_full = torch.randn(13, 700).bfloat16()             # bf16: the int8 dot path
    x = x_full[:, :576]                                  # rows 700 apart
    part = qw[40:136]                                    # a TP shard of rows
    y = gl.gguf_linear(x, part, T.Q4_1, None)
    check_linear(y, x, w[40:136], None)
    one_row = gl.gguf_linear(x[:1], part, T.Q4_1, None)
    threads = torch.get_num_threads()
    try:
        # same per-row arithmetic however the row groups are split and stolen: one thread, and
        # more threads than cores (ranges of 4-5 groups, some taken by other threads)
        for count in (1, 3, 5):
            torch.set_num_threads(count)
            assert torch.equal(gl.gguf_linear(x, part, T.Q4_1, None), y)
            assert torch.equal(gl.gguf_linear(x[:1], part, T.Q4_1, None), one_row)
    finally:
        torch.set_num_threads(threads)


def test_long_prompt_chunks_use_dequantised_tiles(monkeypatch):
    """Past GGUF_AMX_MAX_ROWS rows (and the int8 kernels' limit) bf16 x takes dequantised tiles
    + F.linear (oneDNN)."""
    monkeypatch.setattr(gl, "GGUF_AMX_MAX_ROWS", 16)
    monkeypatch.setattr(gl, "GGUF_TILE_MAX_ROWS", gl.GGUF_DOT_MAX_ROWS)
    monkeypatch.setattr(gl, "_FALLBACK_TILE", 64 * 576)       # 64-row tiles: several of them
    qw = torch.from_numpy(random_weight(T.Q4_1, 208, 576))
    w = gl.gguf_dequantize(qw, T.Q4_1, torch.bfloat16)
    tiles = []
    dequantize = gl.gguf_dequantize
    monkeypatch.setattr(gl, "gguf_dequantize", lambda *a: tiles.append(a[0].shape[0]) or
                        dequantize(*a))
    x, b = torch.randn(40, 576).bfloat16(), torch.randn(208).bfloat16()
    torch.testing.assert_close(gl.gguf_linear(x, qw, T.Q4_1, b), F.linear(x, w) + b)
    assert tiles == [64, 64, 64, 16]
    tiles.clear()
    gl.gguf_linear(x[:16], qw, T.Q4_1, b)                   # 16 rows: the AMX strips (or tiles
    assert tiles == ([] if ops._has_amx else [64, 64, 64, 16])  # without AMX)


def _step(num_tokens: int, num_reqs: int):
    """A forward context for one step of num_reqs requests holding num_tokens tokens."""
    return override_forward_context(ForwardContext(
        no_compile_layers={}, attn_metadata=None,
        batch_descriptor=BatchDescriptor(num_tokens, num_reqs, uniform=num_tokens == num_reqs)))


def test_prompt_rows_without_amx(monkeypatch):
    """No AMX (Ice Lake, Zen 4, Zen 3): with VNNI or AVX2 a decode step of any size takes the
    int8 kernels (VNNI: x^T tiles from 16 rows), within the activation quantization's bound; a
    step with prompt tokens, no step at all, or a scalar build, dequantised tiles + F.linear."""
    gl._resolve()                                              # before the capabilities are set
    monkeypatch.setattr(gl._Native, "amx", False)
    monkeypatch.setattr(gl, "_FALLBACK_TILE", 64 * 576)       # 64-row tiles: several of them
    qw = torch.from_numpy(random_weight(T.Q4_1, 200, 576))
    w = gl.gguf_dequantize(qw, T.Q4_1, torch.float32)
    x, b = torch.randn(40, 576).bfloat16(), torch.randn(200).bfloat16()
    exact = F.linear(x, w.bfloat16()) + b
    if gl._Native.int8_decode:                               # VNNI or AVX2
        with _step(40, 40):                                   # 40 decode rows
            assert gl.gguf_int8_max_rows() >= 1 << 20
            y = gl.gguf_linear(x, qw, T.Q4_1, b)
        check_linear(y, x, w, b)
        assert not torch.equal(y, exact)
    with _step(40, 3):                                        # prompt chunks in the step
        torch.testing.assert_close(gl.gguf_linear(x, qw, T.Q4_1, b), exact)
    assert gl.gguf_int8_max_rows() == gl.GGUF_DOT_MAX_ROWS    # outside a forward pass
    if gl._Native.int8_decode:
        # LM head rows (one sampled position per request, after the forward pass): the int8
        # tiles at any count, the same values as in a decode step
        assert gl.gguf_int8_max_rows(independent_rows=True) >= 1 << 20
        torch.testing.assert_close(gl.gguf_linear(x, qw, T.Q4_1, b, independent_rows=True), y,
                                   rtol=0, atol=0)
    monkeypatch.setattr(gl._Native, "int8_decode", False)     # scalar builds
    assert gl.gguf_int8_max_rows(independent_rows=True) == gl.GGUF_DOT_MAX_ROWS
    with _step(40, 40):
        assert gl.gguf_int8_max_rows() == gl.GGUF_DOT_MAX_ROWS
        torch.testing.assert_close(gl.gguf_linear(x, qw, T.Q4_1, b), exact)


def test_fp32_prompt_tiles_without_amx_or_avx512_bf16(monkeypatch):
    """No AMX and no AVX-512 BF16 (Ice Lake): prompt chunks of FP32_TILE_MIN_ROWS+ rows
    multiply fp32 tiles (the exact dequantised weight, one rounding of the result), shorter ones
    bf16 tiles; fp32 tiles are the closer to fp32 maths."""
    gl._resolve()                                              # before the capabilities are set
    monkeypatch.setattr(gl._Native, "amx", False)
    monkeypatch.setattr(gl._Native, "widen_prompts", True)
    monkeypatch.setattr(cpu_linear, "FP32_TILE_ELEMS", 64 * 576)  # 64-row tiles: several
    qw = torch.from_numpy(random_weight(T.Q4_1, 200, 576))
    w = gl.gguf_dequantize(qw, T.Q4_1, torch.float32)
    gen = torch.Generator().manual_seed(11)
    m = cpu_linear.FP32_TILE_MIN_ROWS + 9
    x, b = torch.randn(m, 576, generator=gen).bfloat16(), torch.randn(200, generator=gen).bfloat16()
    fp32 = F.linear(x.float(), w, b.float())
    with _step(m, 3):                                          # a prompt step
        y = gl.gguf_linear(x, qw, T.Q4_1, b)
        short = gl.gguf_linear(x[:40], qw, T.Q4_1, b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, fp32.bfloat16(), rtol=2 ** -8, atol=1e-5)  # one rounding
    bf16_tiles = F.linear(x, w.bfloat16()) + b
    torch.testing.assert_close(short, bf16_tiles[:40])          # below the bound: bf16 tiles
    assert (y.float() - fp32).abs().mean() < (bf16_tiles.float() - fp32).abs().mean()
    monkeypatch.setattr(gl._Native, "widen_prompts", False)       # AVX-512 BF16 or AMX: bf16 tiles
    with _step(m, 3):
        torch.testing.assert_close(gl.gguf_linear(x, qw, T.Q4_1, b), bf16_tiles)


@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=lambda t: T(t).name)
def test_int8_tiles_within_the_bound(qtype, monkeypatch):
    """The x^T tiles of 16 tokens (csrc/gguf_tiles.h, 16+ rows): ragged token groups (17, 33),
    a second block of 256 tokens (300), rows not a multiple of 4, bias, a strided output, and
    the same values on one thread."""
    if not gl._resolve() or not gl._Native.vnni:
        pytest.skip("no AVX-512 VNNI here: the scalar dot loop has no tiles")
    monkeypatch.setattr(gl, "GGUF_DOT_MAX_ROWS", 1 << 62)     # AMX CPUs too: the int8 kernels
    cols = 512 if qtype in K_QUANTS else 608                # 19 legacy blocks: ragged unit
    qw = torch.from_numpy(random_weight(qtype, 98, cols, seed=3))
    w = torch.from_numpy(quants.dequantize(qw.numpy(), qtype))
    gen = torch.Generator().manual_seed(int(qtype))
    for m in (16, 17, 33, 300):
        x = torch.randn(m, cols, generator=gen).bfloat16()
        bias = torch.randn(98, generator=gen).bfloat16()
        out = torch.zeros(m, 130, dtype=torch.bfloat16)
        y = gl.gguf_linear(x, qw, qtype, bias, out=out[:, 10:108])
        check_linear(y, x, w, bias)
        assert out[:, :10].eq(0).all() and out[:, 108:].eq(0).all()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gl.gguf_linear(x, qw, qtype, bias), y)
    finally:
        torch.set_num_threads(threads)


@functools.cache
def _portable_library(flags: tuple[str, ...]) -> ctypes.CDLL:
    """gguf_gemm.cpp (the GGUF dot and dequantisation kernels) built with extra `flags` (fewer
    instruction sets than this CPU has), its functions typed as `_custom_ops` types them. Built
    once per flags and session (the no-VNNI build serves two tests: ~20 s of compiling each)."""
    import subprocess
    with tempfile.TemporaryDirectory(prefix="minivllm-portable-") as folder:
        out = Path(folder) / "portable.so"
        subprocess.run([ops.cxx_compiler(), *ops._FLAGS, *flags,
                        str(ops._CSRC / "gguf_gemm.cpp"), "-o", str(out)],
                       check=True, capture_output=True, timeout=300)
        lib = ctypes.CDLL(str(out))        # (loaded: the file may go)
    for name, argtypes in ops._SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


# -mno-avx512vnni: the AVX2 kernels (gguf_avx2.h) where the CPU has AVX2; -mno-avx2 (which
# drops AVX-512 too): the scalar loops every CPU runs.
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="-mno-avx512vnni is an x86 flag")
@pytest.mark.parametrize("flags,avx2", [(["-mno-avx512vnni"], ops.cpu_has("avx2")),
                                        (["-mno-avx2"], False)], ids=["no-vnni", "no-avx2"])
def test_portable_build_agrees(monkeypatch, flags, avx2):
    lib = _portable_library(tuple(flags))
    assert lib.minivllm_gguf_has_vnni() == 0 and lib.minivllm_gguf_has_avx2() == int(avx2)
    gl._resolve()       # first: else undoing the patch leaves _Native resolved with no library
    monkeypatch.setattr(gl._Native, "lib", lib)
    monkeypatch.setattr(gl._Native, "amx", False)
    monkeypatch.setattr(gl._Native, "vnni", False)
    monkeypatch.setattr(gl._Native, "int8_decode", avx2)
    for qtype in LEGACY + K_QUANTS:
        cols = 512 if qtype in K_QUANTS else 544
        qw = torch.from_numpy(random_weight(qtype, 22, cols))    # 22: a part of a 4-row group
        ref = quants.dequantize(qw.numpy(), qtype)
        np.testing.assert_array_equal(gl.gguf_dequantize(qw, qtype, torch.float32).numpy(), ref)
        for dtype in (torch.bfloat16, torch.float16):
            got = gl.gguf_dequantize(qw, qtype, dtype)
            assert torch.equal(got, torch.from_numpy(ref).to(dtype))
        x = torch.randn(5, cols)
        check_linear(gl.gguf_linear(x, qw, qtype, None), x, torch.from_numpy(ref), None)
        for m in (1, 2, 3, 4):            # the int8 dot kernels: 4 rows x 1 token, 2 x 1-4
            xb = torch.randn(m, cols).bfloat16()
            check_linear(gl.gguf_linear(xb, qw, qtype, None), xb, torch.from_numpy(ref), None)


@pytest.fixture(scope="module", params=["avx2", "vnni"])
def x8_build(request):
    """(library, rows per x8 group): gguf_gemm.cpp without VNNI (the AVX2 kernels, 8-row groups;
    AVX2 CPUs only), or this CPU's own build where it has VNNI (16-row groups)."""
    if os.uname().machine != "x86_64" or not ops.cpu_has("avx2"):
        pytest.skip("the x8 layout is an x86 SIMD kernel layout")
    if request.param == "avx2":
        return _portable_library(("-mno-avx512vnni",)), 8
    if not ops.native_available() or not ops.native_lib().minivllm_gguf_has_vnni():
        pytest.skip("this CPU's kernels are not the VNNI ones")
    return ops.native_lib(), 16


@pytest.mark.parametrize("qtype", sorted(gl.GGUF_X8_TYPES), ids=lambda t: T(t).name)
def test_x8_layout_same_values_and_products(x8_build, monkeypatch, qtype):
    lib, g = x8_build
    assert lib.minivllm_gguf_has_x8() == g
    gl._resolve()                                              # before the capabilities are set
    monkeypatch.setattr(gl._Native, "lib", lib)
    for name, value in (("resolved", True), ("amx", False), ("vnni", g == 16),
                        ("int8_decode", True), ("x8", True), ("x8_rows", g)):
        monkeypatch.setattr(gl._Native, name, value)
    # 17 blocks (no 64-element unit rounding), or 3 K-quant super-blocks
    cols, rows = (768 if qtype in K_QUANTS else 544), 48
    plain = torch.from_numpy(random_weight(qtype, rows, cols, seed=3))
    ref = torch.from_numpy(quants.dequantize(plain.numpy(), qtype))
    assert gl.gguf_repack_for_cpu(plain[:g + 6].clone(), qtype) == qtype   # not whole groups
    if g == 8 and qtype not in (T.Q4_0, T.Q4_1, T.Q8_0):
        # the AVX2 kernels read only the legacy three in the layout: the rest keep the file's
        assert not lib.minivllm_gguf_has_x8_type(qtype) and qtype not in gl.gguf_x8_types()
        assert gl.gguf_repack_for_cpu(plain.clone(), qtype) == qtype
        return
    assert lib.minivllm_gguf_has_x8_type(qtype) and qtype in gl.gguf_x8_types()
    x8 = plain.clone()
    code = gl.gguf_repack_for_cpu(x8, qtype)
    assert code == qtype | gl.GGUF_X8_LAYOUT and not torch.equal(x8, plain)
    assert torch.equal(gl.gguf_unpack_x8(x8, code), plain)              # same bytes, moved
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(gl.gguf_dequantize(x8, code, dtype), ref.to(dtype))
        assert torch.equal(gl.gguf_dequantize(x8[g:3 * g], code, dtype), ref[g:3 * g].to(dtype))
    ids = torch.tensor([[47, 0, 7], [8, 8, 21]])
    assert torch.equal(gl.gguf_embedding(ids, x8, code, torch.bfloat16), ref[ids].bfloat16())
    with pytest.raises(IndexError, match=r"\[0, 48\)"):
        gl.gguf_embedding(torch.tensor([48]), x8, code, torch.bfloat16)
    bias = torch.randn(rows).bfloat16()
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 17, 23):       # passes of 1-4 (AVX2) or 1-8 tokens (VNNI)
        x = torch.randn(m, cols).bfloat16()
        y = gl.gguf_linear(x, x8, code, bias, independent_rows=True)
        check_linear(y, x, ref, bias)
        # the plain layout's kernel: the same int8 sums, other fp32 summation order
        y_plain = gl.gguf_linear(x, plain, qtype, bias, independent_rows=True)
        torch.testing.assert_close(y, y_plain, rtol=2 ** -7, atol=1e-2)
    out = torch.zeros(2, 2 * g + 16).bfloat16()       # a column slice of a fused output
    x = torch.randn(2, cols).bfloat16()
    gl.gguf_linear(x, x8[g:3 * g], code, None, out=out[:, 8:8 + 2 * g])
    torch.testing.assert_close(out[:, 8:8 + 2 * g], gl.gguf_linear(x, x8, code, None)[:, g:3 * g])
    assert out[:, :8].abs().sum() == 0 and out[:, 8 + 2 * g:].abs().sum() == 0


def test_default_model_first_layer(default_model_path):
    reader = GGUFReader(default_model_path)
    tensors = {t.name: t for t in reader.tensors}
    gen = torch.Generator().manual_seed(0)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        qw = torch.from_numpy(np.array(t.data))                        # [out, row_bytes]
        ref = torch.from_numpy(quants.dequantize(np.array(t.data), t.tensor_type)).reshape(
            qw.shape[0], -1)
        x = torch.randn(2, ref.shape[1], generator=gen).bfloat16()
        check_linear(gl.gguf_linear(x, qw, int(t.tensor_type), None), x, ref, None)
