"""The native paged decode-attention kernel (`cpu_decode_attn.cpp`): built on first use, optional.

The source is compiled once per machine with the system C++ compiler (about 2 s) into
`$MINIVLLM_CACHE_DIR` (default `~/.cache/minivllm`), keyed by the source, the flags and the CPU's
feature flags (the build uses `-march=native`), and loaded with ctypes. Everything still works
without it: when there is no compiler, the build fails, or `MINIVLLM_CPU_KERNEL=0`, the backend
keeps its pure-PyTorch gather + SDPA path.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from minivllm.logger import init_logger

logger = init_logger(__name__)

_SOURCE = Path(__file__).with_name("cpu_decode_attn.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
             ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_int32]
_FUNCS = {torch.bfloat16: "minivllm_paged_decode_bf16", torch.float32: "minivllm_paged_decode_f32"}
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler] + _FLAGS).encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MINIVLLM_CACHE_DIR", Path.home() / ".cache" / "minivllm"))
    target = cache / f"cpu_decode_attn-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent workers (TP ranks) never load a
        # half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp], check=True,
                           capture_output=True, text=True, timeout=300)
            os.replace(tmp, target)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{compiler} failed: {e.stderr.strip()[-2000:]}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    for name in _FUNCS.values():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return lib


def decode_kernel_available() -> bool:
    """Builds/loads the kernel once per process; False (with one warning) when it cannot."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("MINIVLLM_CPU_KERNEL", "1") == "0":
            return False
        try:
            _lib = _build()
        except Exception as e:  # any failure: fall back to the PyTorch path, never crash
            logger.warning("Native CPU decode attention unavailable (%s); using gather + SDPA.", e)
    return _lib is not None


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                           num_heads: int, num_kv_heads: int, head_size: int, window: int,
                           scale: float) -> None:
    """out[rows] = attention of query[rows] over each sequence's cached keys, in place.

    query/out: [T, >= nH*d] with unit stride inside a row; kv_cache: contiguous
    [2, num_blocks, block_size, nKV, d]; block_table: int32 [B, max_blocks] (contiguous rows);
    seq_lens: int32 [B]; rows: int64 [B] (query row of each sequence); window: 0 = unlimited.
    """
    assert _lib is not None, "call decode_kernel_available() first"
    _, num_blocks, block_size, _, head_dim = kv_cache.shape
    elem = kv_cache.element_size()
    v_offset = num_blocks * block_size * num_kv_heads * head_dim * elem
    rc = getattr(_lib, _FUNCS[kv_cache.dtype])(
        query.data_ptr(), query.stride(0), kv_cache.data_ptr(), kv_cache.data_ptr() + v_offset,
        num_kv_heads * head_dim, block_table.data_ptr(), block_table.stride(0),
        seq_lens.data_ptr(), rows.data_ptr(), out.data_ptr(), out.stride(0), rows.shape[0],
        num_heads, num_kv_heads, head_size, block_size, window, scale, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged decode kernel rejected num_heads={num_heads}, "
                         f"num_kv_heads={num_kv_heads}: heads per KV head must divide and be <= 64")


def kernel_supports(dtype: torch.dtype) -> bool:
    return dtype in _FUNCS
