"""Pure-PyTorch GGUF dequantisers (any device): uint8 block rows -> fp32, as gguf-py computes them.

Each type's formula is gguf-py's (`gguf.quants`), in the same fp32 operations and order, so the
result is bit-identical; every op is a whole-tensor op (no loop over blocks).
"""

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] (little-endian fp16 bits) -> fp32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _shifts(*values: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [..., n] -> [..., n // group, 2, group]: low, then high nibbles of `group` bytes."""
    qs = qs.reshape(*qs.shape[:-1], -1, 1, group)
    return (qs >> _shifts(0, 4, device=qs.device).reshape(2, 1)) & 0x0F


def _bit_planes(b: torch.Tensor, count: int, step: int, mask: int) -> torch.Tensor:
    """uint8 [..., 32] -> [..., count, 32]: (b >> step * j) & mask for j < count."""
    shifts = torch.arange(0, step * count, step, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-2) >> shifts.reshape(count, 1)) & mask


def _qh32(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4] (a little-endian uint32) -> its 32 bits [n, 32] as uint8."""
    word = qh.long()
    word = word[:, 0] | (word[:, 1] << 8) | (word[:, 2] << 16) | (word[:, 3] << 24)
    bits = word.unsqueeze(-1) >> torch.arange(32, device=qh.device)
    return (bits & 1).to(torch.uint8)


def _legacy_4(blocks: torch.Tensor, has_min: bool) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    qs = _nibbles(blocks[:, 4 if has_min else 2:], 16).reshape(n, 32)
    if has_min:
        return d * qs.float() + _f16(blocks[:, 2:4])
    return d * (qs.to(torch.int8) - 8).float()


def _legacy_5(blocks: torch.Tensor, has_min: bool) -> torch.Tensor:
    n, at = blocks.shape[0], 4 if has_min else 2
    d = _f16(blocks[:, 0:2])
    q = _nibbles(blocks[:, at + 4:], 16).reshape(n, 32) | (_qh32(blocks[:, at:at + 4]) << 4)
    if has_min:
        return d * q.float() + _f16(blocks[:, 2:4])
    return d * (q.to(torch.int8) - 16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks[:, 0:2])


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _bit_planes(qs.reshape(n, 2, 32), 4, 2, 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])
    low = (scales[:, :8].reshape(n, 1, 8) >> _shifts(0, 4, device=blocks.device).reshape(2, 1))
    high = scales[:, 8:].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6, device=blocks.device).reshape(4, 1)
    sc = (low.reshape(n, 16) & 0x0F) | ((high.reshape(n, 16) & 0x03) << 4)
    dl = (d * (sc.to(torch.int8) - 32).float()).reshape(n, 16, 1)
    ql = _bit_planes(qs.reshape(n, 2, 32), 4, 2, 3).reshape(n, 16, 16)
    qh = _bit_planes(hmask, 8, 1, 1).reshape(n, 16, 16) ^ 1    # 1: no offset
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [n, 12] -> 6-bit scales and mins [n, 8] of Q4_K / Q5_K."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q45_k(blocks: torch.Tensor, five: bool) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 48 if five else 16:], 32).reshape(n, 8, 32)
    if five:
        q = q | (_bit_planes(blocks[:, 16:48], 8, 1, 1) << 4)
    return (dl * q.float() - dm).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
    d = _f16(blocks[:, 208:210])
    dl = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    high = _bit_planes(qh.reshape(n, 2, 32), 4, 2, 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (dl * q).reshape(n, QK_K)


# Byte offsets of each K-quant block's fp16 super-block scales (d, then dmin), by type name:
# where random blocks (benchmarks, tests) need finite values.
K_SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}

DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: lambda b: _legacy_4(b, False), T.Q4_1: lambda b: _legacy_4(b, True),
    T.Q5_0: lambda b: _legacy_5(b, False), T.Q5_1: lambda b: _legacy_5(b, True),
    T.Q8_0: _q8_0, T.Q2_K: _q2_k, T.Q3_K: _q3_k,
    T.Q4_K: lambda b: _q45_k(b, False), T.Q5_K: lambda b: _q45_k(b, True), T.Q6_K: _q6_k,
}


def dequantize_torch(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] GGUF block rows -> fp32 [rows, cols] (a supported `qtype`)."""
    elems, nbytes = GGML_QUANT_SIZES[T(qtype)]
    rows, row_bytes = qweight.shape
    blocks = qweight.reshape(rows * (row_bytes // nbytes), nbytes)
    return DEQUANTIZERS[qtype](blocks).reshape(rows, row_bytes // nbytes * elems)
