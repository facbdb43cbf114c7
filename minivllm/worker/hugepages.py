"""2 MB pages for the large CPU tensors a step streams: the paged KV cache and the weights.

Why: a batched decode step reads its sequences' KV blocks scattered over ~300 MB and every weight
once. On 4 KB pages nearly every 6 KB KV block costs a TLB miss (two-level page walks under a
hypervisor); with transparent huge pages the decode kernel ran ~10% faster (same process, 30
layers at batch 64) and the linears 3-4%. Linux gives a range huge pages only when asked
(`/sys/kernel/mm/transparent_hugepage/enabled` is usually "madvise"), and only for whole 2 MB
pages not yet touched, so the tensors are carved out of one fresh, 2 MB-aligned, madvised arena.
Where madvise is unavailable or refused, the arena is ordinary memory: only speed differs.
"""

import ctypes
import ctypes.util
import mmap
import os
import sys

import torch

from minivllm.logger import init_logger

logger = init_logger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGN = 64          # every tensor in an arena starts on a cache line
_MIN_PARAM_BYTES = 1 << 16   # smaller parameters (norm weights) are not worth moving
_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                _madvise = libc.madvise
            except (OSError, AttributeError):
                pass
    return _madvise


def enabled() -> bool:
    """False when MINIVLLM_HUGEPAGES=0 (plain allocations, e.g. to measure the difference)."""
    return os.environ.get("MINIVLLM_HUGEPAGES", "1") != "0"


def arena(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 [nbytes] CPU tensor; its 2 MB-aligned span is madvised for huge pages
    before anything touches it.

    The memory is an anonymous mapping, which the kernel fills with zeros page by page on first
    touch: a 2 GiB KV budget costs no time and no resident memory until blocks are written (a
    `zero_()` here took ~1 s and made the whole budget resident at start-up)."""
    # MAP_PRIVATE | MAP_ANONYMOUS; the tensor keeps the mmap object (and so the mapping) alive.
    raw = torch.frombuffer(mmap.mmap(-1, nbytes + HUGE_PAGE), dtype=torch.uint8)
    offset = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[offset:offset + nbytes]
    madvise = _libc_madvise()
    if madvise and enabled() and nbytes >= HUGE_PAGE:
        span = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE  # inside raw: offset + span <= len
        if madvise(buf.data_ptr(), span, _MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
    return buf


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def zeros(shapes: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Zeroed contiguous CPU tensors of the given shapes and dtypes, all in one arena."""
    sizes = [torch.Size(s).numel() * d.itemsize for s, d in shapes]
    buf = arena(sum(_aligned(n) for n in sizes))
    out, offset = [], 0
    for (shape, dtype), n in zip(shapes, sizes):
        out.append(buf[offset:offset + n].view(dtype).view(shape))
        offset += _aligned(n)
    return out


def rehome_parameters(model: torch.nn.Module) -> int:
    """Moves the model's large dense CPU parameters into one huge-page arena (same Parameter
    objects, attributes kept: only `.data` changes). Returns the bytes moved.

    Only parameters that own their whole storage move: one that views another's (or is viewed)
    would lose that sharing; `keep_in_place` ones (packed GGUF weights) stay too."""
    if not enabled() or not _libc_madvise():
        return 0
    owners: dict[int, int] = {}
    params = list(model.parameters())
    for p in params:
        key = p.untyped_storage().data_ptr()
        owners[key] = owners.get(key, 0) + 1
    movable = [p for p in params
               if p.device.type == "cpu" and p.is_contiguous() and p.storage_offset() == 0
               and p.numel() * p.element_size() >= _MIN_PARAM_BYTES
               and p.untyped_storage().nbytes() == p.numel() * p.element_size()
               and owners[p.untyped_storage().data_ptr()] == 1
               and not getattr(p, "keep_in_place", False)]
    if not movable:
        return 0
    homes = zeros([(p.shape, p.dtype) for p in movable])
    with torch.no_grad():
        for p, home in zip(movable, homes):
            home.copy_(p.data)
            p.data = home
    return sum(h.numel() * h.element_size() for h in homes)
