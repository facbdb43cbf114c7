"""Linears and embeddings on GGUF-packed weights: uint8 block rows, exactly as in the .gguf file.

- `gguf_linear` on CPU with the native kernels (`csrc/gguf_gemm.cpp`): up to `gguf_dot_max_rows`
  bf16 / fp16 rows of x (decode steps) multiply the packed blocks directly, x quantized to int8
  per 32 elements (AVX-512 VNNI, else AVX2, else a scalar loop). With AMX, more rows (batched decode
  steps, prompt chunks up to `GGUF_AMX_MAX_ROWS`) go to `csrc/gguf_amx.cpp`, which dequantises
  16 weight rows at a time into a bf16 strip and runs AMX tile products on it (longer chunks or
  fp16 x: dequantised tiles through `F.linear`). With VNNI but no AMX the int8 kernels take
  decode steps of every size (`GGUF_TILE_MAX_ROWS`: from 16 rows, x^T tiles of 16 tokens) and
  prompt chunks the dequantised tiles (fp32 tiles from `FP32_TILE_MIN_ROWS` rows where the
  CPU lacks AVX-512 BF16 too; AVX2-only CPUs take the same route, torch's bf16 GEMM below it:
  fp32 tiles there from fewer rows flipped the default model's chat answer). fp32 x, the
  reference precision, always takes the dequantised tiles (exact weights, no int8 step). The
  whole weight is never widened at once.
- other devices, or no native kernels: `gguf_dequantize` + `F.linear` (correct, not fast).
- `gguf_dequantize`: native on CPU, else the pure-PyTorch dequantisers of `gguf_dequant`.
"""

import ctypes

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from minivllm import _custom_ops as ops
from minivllm import envs
from minivllm.forward_context import is_decode_only_step, is_prompt_step
from minivllm.model_executor.kernels.cpu_linear import FP32_TILE_MIN_ROWS, fp32_tiles
from minivllm.model_executor.kernels.embedding import gather_rows
from minivllm.model_executor.kernels.gguf_dequant import DEQUANTIZERS, dequantize_torch
from minivllm.model_executor.kernels.op_library import register_op

GGUF_KERNEL_TYPES: frozenset[int] = frozenset(int(t) for t in DEQUANTIZERS)
# Float tensor types: stored as plain [rows, cols] tensors and multiplied by `F.linear`.
GGUF_FLOAT_TYPES: frozenset[int] = frozenset(
    int(t) for t in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16))
# (elements, bytes) per block of each supported type: a plain dict, read on every call.
_BLOCKS: dict[int, tuple[int, int]] = {
    t: GGML_QUANT_SIZES[GGMLQuantizationType(t)] for t in GGUF_KERNEL_TYPES}
# The x8 layout (csrc/gguf_x8_layout.h): blocks of 8 rows (AVX2) or 16 (AVX-512 VNNI)
# interleaved for the dot kernels without AMX, the same bytes as the file's. A flag on the type
# code the kernels take (`qweight_kernel_type`).
GGUF_X8_LAYOUT = 1 << 8
_X8_MAX_ROWS = 16          # rows of the widest x8 group: dequantised tiles start at its multiples
# Every block type has the layout in some build: the AVX2 kernels take Q4_0/Q4_1/Q8_0, the VNNI
# ones all (`gguf_x8_types()`: this CPU's).
GGUF_X8_TYPES: frozenset[int] = GGUF_KERNEL_TYPES
_BLOCKS.update({t | GGUF_X8_LAYOUT: _BLOCKS[t] for t in GGUF_X8_TYPES})
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Rows of x up to which the int8 dot kernels (file layout) beat the AMX strips (gguf_amx.cpp):
# the dot's cost grows with each row of x, the strips' stays at the dequantisation; on the 2-core
# box (30 layers of the default model's Q4_1 linears, weights from memory as in a step) the dot
# wins at 4 rows, the strips from 8; the Q8_0 LM head takes the strips from 5 rows.
GGUF_DOT_MAX_ROWS = 4
# The same for x8 weights (`gguf_dot_max_rows`), for K from / under 1024: their kernels take 8
# tokens per pass over a group held in L1, ~390 GMAC/s on 2 threads at any count, while the
# strips' dequantisation costs as much as 16-22 rows of that at K 2048-4096 and 8-10 at K 576
# (Sapphire Rapids VM, Q4_1). Decode tok/s there, 4 rows -> these: default model at 6 / 8 / 12
# requests 598 -> 1035 / 726 -> 1104 / 1055 -> 1154 (level from 16); bench moe's model at 8 /
# 12 / 16 requests 369 -> 457 / 445 -> 504 / 521 -> 564.
GGUF_X8_DOT_MAX_ROWS = (16, 8)
# Rows of bf16 / fp16 x the int8 kernels take in decode steps on CPUs with VNNI or AVX2 but no
# AMX (Ice Lake, Zen 4; Zen 3 with the AVX2 dot kernels): with VNNI from 16 rows gguf_gemm.cpp
# multiplies x^T tiles of 16 tokens (csrc/gguf_tiles.h), 170-250 GFLOP/s on the 2-core Ice Lake
# box for 16-1024 rows of the default model's linears: 3-4x dequantised tiles + oneDNN in bf16
# (no AVX-512 BF16 there), level with or ahead of oneDNN in fp32. So every decode step takes them.
GGUF_TILE_MAX_ROWS = 1 << 62
# Rows of x up to which the AMX strips beat dequantised tiles + oneDNN (`F.linear`): the strips
# re-read x^T from L2 for every 32 weight rows, which oneDNN's blocking avoids; measured as
# above: strips 1.0-1.2x the bf16 path's speed at 256-512 rows, oneDNN tiles ahead from 768.
GGUF_AMX_MAX_ROWS = 512
_FALLBACK_TILE = 1 << 22   # elements of a dequantised tile on the `F.linear` fallback path
# Prompt chunks from `cpu_linear.FP32_TILE_MIN_ROWS` (64) rows multiply fp32 tiles on CPUs whose
# bf16 GEMMs run in software (`ops.bf16_gemm_in_software`): 2.3-3.5x the bf16 tiles on Ice Lake
# for the default model's Q4_1 linears at 64-512 rows, and fp32 products of the exact
# dequantised weight are closer to the fp32 reference. Shorter chunks keep bf16 tiles (1.3-1.5x
# at 36 rows), which also keeps the default model's answer to its 36-token chat prompt: its first
# token is a near tie that fp32 tiles (with bf16 activations) flip to "L'Étoile", as llama.cpp
# answers, where transformers' fp32 reference says "The capital".


class _Native:
    """The kernel library and its capabilities, resolved once (first call)."""
    resolved = False
    lib: ctypes.CDLL | None = None
    amx = False
    vnni = False
    int8_decode = False    # decode steps of any size take the int8 kernels (VNNI or AVX2, no AMX)
    widen_prompts = False  # bf16 / fp16 prompt tiles in fp32 (no AMX, no AVX-512 BF16)
    x8 = False             # GGUF_X8_TYPES weights take the x8 layout (`_x8_wanted`)
    x8_rows = 0            # rows per x8 group: 8 (AVX2 kernels), 16 (AVX-512 VNNI)


def _resolve() -> ctypes.CDLL | None:
    _Native.resolved = True
    if ops.native_available():
        _Native.lib = ops.native_lib()
        _Native.amx = ops._has_amx
        _Native.vnni = bool(_Native.lib.minivllm_gguf_has_vnni())
        avx2 = bool(_Native.lib.minivllm_gguf_has_avx2())
        _Native.int8_decode = _Native.vnni or avx2
        _Native.x8_rows = int(_Native.lib.minivllm_gguf_has_x8())
        _Native.x8 = bool(_Native.x8_rows) and _x8_wanted()
        _Native.widen_prompts = ops.bf16_gemm_in_software()   # implies no AMX
    return _Native.lib


def _x8_wanted() -> bool:
    """envs.MINIVLLM_GGUF_X8: "auto" or "1", the x8 layout wherever its kernels are built; "0",
    the file layout. On AMX CPUs x8 weights take the x8 dot kernels up to `gguf_dot_max_rows`
    rows and the AMX strips above (Q4_0 / Q4_1 / Q8_0 dequantised straight from the groups,
    other types un-interleaved first). Measured on the 2-core Sapphire Rapids VM, default model,
    A/B in one session: batch-1 decode 283 tok/s against 222 for the file layout (llama.cpp:
    94-97), prompt 871 against 750; `bench throughput` level (1043 / 993 against 1032 / 1042
    output tok/s); `bench moe --gguf-type Q4_1` batch 929-985 against 752-777 tok/s."""
    return envs.MINIVLLM_GGUF_X8 in ("auto", "1")


def gguf_int8_max_rows(independent_rows: bool = False) -> int:
    """Rows of bf16 / fp16 x up to which `gguf_linear` runs the int8 kernels on this CPU and step
    (more: the AMX strips or dequantised tiles). Only decode-only steps give more than
    `GGUF_DOT_MAX_ROWS` rows to the int8 tiles: int8 activations over a whole prompt flipped the
    default model's first chat token (a near tie in bf16), so prompt steps keep the dequantised
    bf16 weights, as on every CPU. `independent_rows`: each row is one request's own product
    (the LM head's sampled positions, computed after the forward pass), so the int8 tiles take
    any count, and a request's logits do not depend on how many rows share its step. AVX2 CPUs
    (no x^T tiles) run their dot kernels at every count there: 4-5x the dequantised tiles at
    6-32 rows on the 2-core Zen 3 box, even at 64, and a request's tokens then do not depend on
    the batch either."""
    if not _Native.resolved:
        _resolve()
    amx_strips = _Native.amx      # x8 weights too (x8 x^T tiles there: throughput 0.75x bf16)
    if amx_strips or not _Native.int8_decode or not (independent_rows or is_decode_only_step()):
        return GGUF_DOT_MAX_ROWS
    return GGUF_TILE_MAX_ROWS


def gguf_dot_max_rows(qtype: int, k: int) -> int:
    """Rows of x up to which a decode step (or the LM head) takes the int8 dot kernels for a
    weight of kernel type `qtype` and K `k` on this CPU, where `gguf_int8_max_rows` gives no more:
    `GGUF_X8_DOT_MAX_ROWS` for x8 weights on AMX CPUs, else `GGUF_DOT_MAX_ROWS`."""
    if _Native.amx and qtype & GGUF_X8_LAYOUT:
        return GGUF_X8_DOT_MAX_ROWS[0 if k >= 1024 else 1]
    return GGUF_DOT_MAX_ROWS


def gguf_block_shape(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML quantization type."""
    return tuple(GGML_QUANT_SIZES[GGMLQuantizationType(qtype)])


def check_gguf_type(qtype: int, name: str = "") -> None:
    """ValueError, naming the type and the tensor, when no kernel here handles `qtype`."""
    if qtype in _BLOCKS:
        return
    try:
        type_name = GGMLQuantizationType(qtype).name
    except ValueError:
        type_name = f"unknown type {qtype}"
    supported = ", ".join(GGMLQuantizationType(t).name for t in sorted(GGUF_KERNEL_TYPES))
    where = f" of tensor {name!r}" if name else ""
    raise ValueError(f"GGUF quantization type {type_name}{where} is not supported; "
                     f"supported: {supported}")


def gguf_repack_for_cpu(qweight: torch.Tensor, qtype: int) -> int:
    """The type code the kernels take for this packed weight (`qweight_kernel_type`): on CPUs
    whose int8 kernels are the AVX2 or AVX-512 VNNI ones, a contiguous CPU weight of
    `gguf_x8_types()` in whole groups of `gguf_x8_rows()` rows is rearranged in place into the x8
    layout (`qtype | GGUF_X8_LAYOUT`; same bytes, so no extra memory). Its rows then no longer
    read as file rows: use the returned code everywhere. Zen 3 (8-row groups): 1.7-2.0x the
    plain layout's AVX2 kernel at 1 row; batch-1 decode of the default model 74 -> 92 tok/s.
    `MINIVLLM_GGUF_X8` (envs): `_x8_wanted`."""
    lib = _Native.lib if _Native.resolved else _resolve()
    if (lib is None or not _Native.x8 or qtype not in GGUF_X8_TYPES or not qweight.is_cpu
            or qweight.dim() != 2 or qweight.dtype != torch.uint8
            or qweight.shape[0] % _Native.x8_rows or not qweight.is_contiguous()
            or not lib.minivllm_gguf_has_x8_type(qtype)):
        return qtype
    rc = lib.minivllm_gguf_repack_x8(qtype, qweight.data_ptr(), qweight.shape[1],
                                     qweight.shape[0], 1, torch.get_num_threads())
    assert rc == 0, f"gguf repack kernel rc={rc}"
    return qtype | GGUF_X8_LAYOUT


def gguf_uses_x8() -> bool:
    """Whether `gguf_repack_for_cpu` rearranges weights on this CPU (`_x8_wanted`)."""
    if not _Native.resolved:
        _resolve()
    return _Native.x8


def gguf_x8_types() -> frozenset[int]:
    """The GGML types `gguf_repack_for_cpu` lays out in the x8 layout on this CPU: Q4_0, Q4_1,
    Q8_0 with the AVX2 kernels; also Q5_0, Q5_1 and Q2_K ... Q6_K with AVX-512 VNNI."""
    if not gguf_uses_x8():
        return frozenset()
    return frozenset(t for t in GGUF_X8_TYPES if _Native.lib.minivllm_gguf_has_x8_type(t))


def gguf_x8_rows() -> int:
    """Rows per x8 group here: 8 (AVX2 kernels), 16 (AVX-512 VNNI); 0: the file's layout."""
    return _Native.x8_rows if gguf_uses_x8() else 0


def gguf_unpack_x8(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """A copy of an x8 weight in the file's layout (checks and tests)."""
    out = qweight.contiguous().clone()
    if qtype & GGUF_X8_LAYOUT:
        rc = _Native.lib.minivllm_gguf_repack_x8(qtype & ~GGUF_X8_LAYOUT, out.data_ptr(),
                                                 out.shape[1], out.shape[0], 0, 1)
        assert rc == 0, f"gguf repack kernel rc={rc}"
    return out


def _type_name(qtype: int) -> str:
    name = GGMLQuantizationType(qtype & ~GGUF_X8_LAYOUT).name
    return f"{name} (x8 layout)" if qtype & GGUF_X8_LAYOUT else name


def _columns(qweight: torch.Tensor, qtype: int) -> int:
    check_gguf_type(qtype)
    elems, nbytes = _BLOCKS[qtype]
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] % nbytes:
        raise ValueError(f"GGUF weight must be uint8 [rows, blocks * {nbytes}] for "
                         f"{_type_name(qtype)}, got {qweight.dtype} {list(qweight.shape)}")
    return qweight.shape[1] // nbytes * elems


def gguf_dequantize(qweight: torch.Tensor, qtype: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [rows, row_bytes] block rows -> [rows, cols] in `dtype` (bit-exact to gguf-py's fp32
    values, then one rounding to `dtype`)."""
    cols = _columns(qweight, qtype)
    code = _DTYPE_CODES.get(dtype)
    lib = _Native.lib if _Native.resolved else _resolve()
    if lib is None or qweight.device.type != "cpu" or code is None:
        if qtype & GGUF_X8_LAYOUT:
            raise ValueError(f"a {_type_name(qtype)} weight dequantises only on CPU, into "
                             f"float32, bfloat16 or float16")
        return dequantize_torch(qweight, qtype).to(dtype)
    if qweight.stride(1) != 1:
        qweight = qweight.contiguous()
    out = torch.empty(qweight.shape[0], cols, dtype=dtype)
    rc = lib.minivllm_gguf_dequant(qtype, qweight.data_ptr(), qweight.stride(0),
                                   qweight.shape[0], cols, out.data_ptr(), cols, code,
                                   torch.get_num_threads())
    assert rc == 0, f"gguf dequant kernel rc={rc}"
    return out


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int,
                bias: torch.Tensor | None, out: torch.Tensor | None = None,
                independent_rows: bool = False) -> torch.Tensor:
    """`F.linear(x, dequantized weight, bias)` for x [..., in] (bf16, fp16 or fp32) and a
    uint8 [out, row_bytes] GGUF weight (unit-stride rows; a row slice is fine); returns
    [..., out] in x.dtype. `out` (2-D x only): a [m, n] x.dtype view with unit-stride rows to
    write into, e.g. a column slice of a fused layer's output (the kernels take its row stride).
    `independent_rows`: see `gguf_int8_max_rows` (the LM head)."""
    # NOTE: ~120 calls per decode step: the common path is a few attribute and dict lookups
    # (each tensor property read once).
    lib = _Native.lib if _Native.resolved else _resolve()
    code = _DTYPE_CODES.get(x.dtype)
    shape = x.shape
    if lib is None or code is None or len(shape) != 2 or not x.is_cpu or not qweight.is_cpu:
        if len(shape) != 2:
            assert out is None, "out= needs 2-D x"
            return gguf_linear(x.reshape(-1, shape[-1]), qweight, qtype,
                               bias).reshape(*shape[:-1], qweight.shape[0])
        return _into(out, F.linear(x, gguf_dequantize(qweight, qtype, x.dtype), bias))
    (m, k), (n, row_bytes) = shape, qweight.shape
    elems, nbytes = _BLOCKS.get(qtype) or _unsupported(qtype)
    if k % elems or row_bytes * elems != k * nbytes or qweight.dtype != torch.uint8:
        raise ValueError(f"x [{m}, {k}] does not match the {_type_name(qtype)} "
                         f"weight {qweight.dtype} {list(qweight.shape)}")
    x_stride = x.stride()
    if x_stride[1] != 1:
        x = x.contiguous()
        x_stride = x.stride()
    if bias is not None and (bias.dtype != x.dtype or bias.stride(0) != 1):
        bias = bias.to(x.dtype).contiguous()
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be a [{m}, {n}] {x.dtype} tensor with unit-stride rows, got "
                         f"{out.dtype} {list(out.shape)} strides {out.stride()}")
    if (code == 0 or (m > GGUF_DOT_MAX_ROWS and m > gguf_dot_max_rows(qtype, k)   # (>= that)
                      and m > gguf_int8_max_rows(independent_rows))
            or (not independent_rows and is_prompt_step())):
        # fp32 x is the reference precision (runs checked against transformers): no int8 step,
        # whatever the row count, so results do not depend on how rows were batched. Prompt
        # steps never quantize x either, however few rows they bring: a prompt's tail
        # recomputed after a prefix-cache hit sees the weights as the whole prompt did.
        return _prompt_linear(lib, x, qweight, qtype, bias, out)
    y = torch.empty((m, n), dtype=x.dtype) if out is None else out
    if m == 0:
        return y
    rc = lib.minivllm_gguf_gemm(qtype, x.data_ptr(), x_stride[0], code, qweight.data_ptr(),
                                qweight.stride(0), bias.data_ptr() if bias is not None else None,
                                y.data_ptr(), y.stride(0), m, n, k, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gguf_gemm kernel rejected M={m}, N={n}, K={k} (rc={rc})")
    return y


def gguf_matmul(x: torch.Tensor, weight: torch.Tensor, qtype: int,
                bias: torch.Tensor | None, independent_rows: bool = False) -> torch.Tensor:
    """x [T, in] @ W^T for one GGUF matrix: packed blocks (`gguf_linear`, an opaque op in
    compiled graphs) or a float type's plain [out, in] tensor (`F.linear`)."""
    if qtype in GGUF_FLOAT_TYPES:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return torch.ops.minivllm.gguf_linear(x, weight, qtype, bias)
    return gguf_linear(x, weight, qtype, bias, independent_rows=independent_rows)


def _unsupported(qtype: int) -> tuple[int, int]:
    check_gguf_type(qtype)
    raise AssertionError(qtype)


def _into(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    return y if out is None else out.copy_(y)


def _prompt_linear(lib: ctypes.CDLL, x: torch.Tensor, qweight: torch.Tensor, qtype: int,
                   bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Many rows of x: bf16 AMX strips up to `GGUF_AMX_MAX_ROWS` rows, else the weight dequantised
    one tile of rows at a time (never all of it) into `F.linear` (in fp32 from
    `FP32_TILE_MIN_ROWS` rows where bf16 GEMMs run in software: `cpu_linear.fp32_tiles`)."""
    (m, k), n = x.shape, qweight.shape[0]
    if _Native.amx and x.dtype == torch.bfloat16 and n % 16 == 0 and m <= GGUF_AMX_MAX_ROWS:
        y = x.new_empty(m, n) if out is None else out
        rc = lib.minivllm_gguf_gemm_amx_bf16(
            qtype, x.data_ptr(), x.stride(0), qweight.data_ptr(), qweight.stride(0),
            None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), m, n, k,
            torch.get_num_threads())
        if rc == 0:
            return y
    if _Native.widen_prompts and x.dtype != torch.float32 and m >= FP32_TILE_MIN_ROWS:
        y = fp32_tiles(x, qweight, bias, lambda rows: gguf_dequantize(rows, qtype, torch.float32),
                       row_multiple=_X8_MAX_ROWS)
        return _into(out, y)
    tile_rows = max(16, _FALLBACK_TILE // k) // _X8_MAX_ROWS * _X8_MAX_ROWS   # whole x8 groups
    parts = [F.linear(x, gguf_dequantize(qweight[n0:n0 + tile_rows], qtype, x.dtype))
             for n0 in range(0, n, tile_rows)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return _into(out, y if bias is None else y + bias)


def gguf_embedding(ids: torch.Tensor, qweight: torch.Tensor, qtype: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """ids int64 [...] -> [..., hidden]: the ids' rows of a GGUF table, only those dequantised
    (one native call on CPU, which a CPU graph records; either layout)."""
    lib = _Native.lib if _Native.resolved else _resolve()
    code = _DTYPE_CODES.get(dtype)
    # (compiled graphs reach this through the opaque op below: it runs eagerly, so an x8 table,
    # whose rows are no file rows, always takes the native call on CPU)
    if lib is None or code is None or not qweight.is_cpu:
        rows = gather_rows(qweight, ids.reshape(-1))           # [n, row_bytes] packed rows
        return gguf_dequantize(rows, qtype, dtype).reshape(*ids.shape, -1)
    cols = _columns(qweight, qtype)
    flat = ids.reshape(-1)
    if flat.dtype != torch.int64 or not flat.is_contiguous():
        flat = flat.to(torch.int64).contiguous()
    if qweight.stride(1) != 1:
        qweight = qweight.contiguous()
    out = torch.empty(flat.shape[0], cols, dtype=dtype)
    rc = lib.minivllm_gguf_embedding(qtype, qweight.data_ptr(), qweight.stride(0),
                                     qweight.shape[0], flat.data_ptr(), flat.shape[0], cols,
                                     out.data_ptr(), cols, code, torch.get_num_threads())
    if rc == 2:
        raise IndexError(f"embedding id out of range: ids must be in [0, {qweight.shape[0]})")
    assert rc == 0, f"gguf embedding kernel rc={rc}"
    return out.reshape(*ids.shape, cols)


def _gguf_linear_fake(x: torch.Tensor, qweight: torch.Tensor, qtype: int,
                      bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


# `torch.ops.minivllm.gguf_linear`: opaque to compiled graphs (inductor must not try to lower
# the block decoding).
register_op("gguf_linear(Tensor x, Tensor qweight, int qtype, Tensor? bias) -> Tensor",
            gguf_linear, _gguf_linear_fake)


def _gguf_embedding_op(ids: torch.Tensor, qweight: torch.Tensor, qtype: int,
                       dtype: torch.dtype) -> torch.Tensor:
    return gguf_embedding(ids, qweight, qtype, dtype)


def _gguf_embedding_fake(ids: torch.Tensor, qweight: torch.Tensor, qtype: int,
                         dtype: torch.dtype) -> torch.Tensor:
    cols = qweight.shape[1] // _BLOCKS[qtype][1] * _BLOCKS[qtype][0]
    return qweight.new_empty(*ids.shape, cols, dtype=dtype)


# `torch.ops.minivllm.gguf_embedding`: the lookup as one opaque op in compiled graphs (tracing
# into it would break the graph at the native call).
register_op("gguf_embedding(Tensor ids, Tensor qweight, int qtype, ScalarType dtype) -> Tensor",
            _gguf_embedding_op, _gguf_embedding_fake)
