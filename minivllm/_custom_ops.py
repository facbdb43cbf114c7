"""Native CPU kernels (`minivllm/csrc/*.cpp`): built on first use, always optional.

The sources are compiled once per machine with the system C++ compiler (each file its own job,
all at once: ~30 s of CPU) into `$MINIVLLM_CACHE_DIR` (default `~/.cache/minivllm`), keyed by the
sources, the flags and the CPU's feature flags (`-march=native`), and loaded with ctypes; their
OpenMP runtime is the one torch already loaded. Everything works without them: when there is
no compiler, the build fails, or `MINIVLLM_CPU_KERNEL=0`, callers keep their pure-PyTorch paths.

- `gemv_bf16`: decode-sized bf16 linear (1..GEMV_MAX_ROWS rows), faster than oneDNN there.
- `gemm_bf16`: bf16 linear with AMX tiles (decode steps; prompt chunks of small weights), faster
  than oneDNN there; `gemm_silu_mul_bf16` the same with SiluAndMul applied to gate_up's output.
- `silu_and_mul_bf16`: SiluAndMul on bf16 rows (~3x faster than inductor's kernel at [64, 3072]).
- `rms_norm_bf16`: RMSNorm (after the residual add) of bf16 rows in one pass, for eager steps.
- `argmax_bf16`: row argmax of bf16 logits (plain-greedy sampling), ~10x faster than `max`.
- `minivllm_gguf_*`, `minivllm_rotary_embedding_bf16`, `minivllm_gather_rows`, the paged decode
  and prompt attention kernels: wrapped in `model_executor/kernels/` (gguf_linear.py,
  rotary_embedding.py, embedding.py, attention.py).
"""

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from minivllm.logger import init_logger

logger = init_logger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}


def _signatures() -> dict[str, list]:
    """`csrc/kernels.h`'s prototypes as ctypes argument lists: the header is the one home of
    the kernels' signatures (every source compiles against it). Pointers travel as void*."""
    text = re.sub(r"//[^\n]*", "", (_CSRC / "kernels.h").read_text())
    signatures = {}
    for name, params in re.findall(r"\bint\s+(minivllm_\w+)\s*\(([^)]*)\)\s*;", text):
        args = [p.strip() for p in params.split(",") if p.strip() not in ("", "void")]
        signatures[name] = [ctypes.c_void_p if "*" in p
                            else _C_TYPES[p.replace("const ", "").split()[0]] for p in args]
    return signatures


_SIGNATURES = _signatures()


class NativeLibrary:
    """The loaded kernels, one attribute per function of `_SIGNATURES`: a CPU graph swaps them
    for recorders while it captures (`compilation/cpu_graph.py`). NOTE: callers look a function
    up here at each call (`lib.minivllm_...(...)`), never keep the function itself."""

    def __init__(self, cdll: ctypes.CDLL) -> None:
        self.cdll = cdll
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(cdll, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            setattr(self, name, fn)

    @staticmethod
    def function_names() -> tuple[str, ...]:
        return tuple(_SIGNATURES)


_lib: NativeLibrary | None = None
_tried = False
_has_gemv = False
_has_amx = False
# Rows a linear sends to the AMX GEMM (it takes any count, 64 at a time): decode steps always;
# prompts of up to GEMM_PROMPT_ROWS rows too when the weight (elements) fits two cores' L2, so
# each 64-row chunk finds it there (measured: 15-25% faster than oneDNN at 256-1024 rows, about
# even at 2048, where oneDNN keeps them). Larger weights (an LM head) stay with oneDNN.
GEMM_MAX_ROWS = 64
# Rows of x the bf16 GEMV takes on CPUs without AMX (batched decode steps): it streams the weight
# once for all of them, where oneDNN's bf16 GEMM (without AVX-512 BF16 on Ice Lake) is 3-4x
# slower at 2-8 rows, and as native calls these steps replay as CPU graphs.
GEMV_MAX_ROWS = 8
GEMM_PROMPT_ROWS = 1024
GEMM_PROMPT_WEIGHT = 1 << 21


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


@functools.lru_cache(maxsize=None)
def cpu_has(flag: str) -> bool:
    """True when /proc/cpuinfo lists `flag` (e.g. "avx512_bf16") for this CPU."""
    return flag in _cpu_flags().split()


def bf16_gemm_in_software() -> bool:
    """True on CPUs without bf16 matrix instructions (neither AMX nor AVX-512 BF16: Ice Lake,
    Skylake-X, AVX2-only CPUs), where oneDNN's bf16 GEMMs convert in software: on the 2-core
    Ice Lake box they ran at ~1/3 of its fp32 speed, so long bf16 prompt chunks widen to fp32
    (`cpu_linear.FP32_TILE_MIN_ROWS`)."""
    return not (cpu_has("amx_bf16") or cpu_has("avx512_bf16"))


def cxx_compiler() -> str | None:
    """The C++ compiler the kernels build with: `$CXX`, else g++ or c++ on PATH (None: none)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build() -> NativeLibrary:
    compiler = cxx_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH")
    sources = sorted(_CSRC.glob("*.cpp"))
    digest = hashlib.sha256(" ".join([compiler] + _FLAGS).encode() + _cpu_flags().encode())
    for src in sorted(_CSRC.glob("*.[ch]*")):                   # sources and headers
        digest.update(src.name.encode() + src.read_bytes())
    cache = Path(os.environ.get("MINIVLLM_CACHE_DIR", Path.home() / ".cache" / "minivllm"))
    target = cache / f"minivllm_kernels-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent workers (TP ranks) never load a
        # half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            with tempfile.TemporaryDirectory(dir=cache) as objects:
                _compile(compiler, sources, Path(objects), tmp)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return NativeLibrary(ctypes.CDLL(str(target)))


def _compile(compiler: str, sources: list[Path], objects: Path, out: str) -> None:
    """One object per source, all compiling at once (a cold build is ~30 s of CPU: serially
    that is the whole wait), then one link."""
    flags = [f for f in _FLAGS if f != "-shared"]
    cmds = [[compiler, *flags, "-c", str(src), "-o", str(objects / src.stem)] for src in sources]
    jobs = [(src, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            for src, cmd in zip(sources, cmds)]
    errors = []
    for src, job in jobs:
        _, stderr = job.communicate(timeout=600)
        if job.returncode != 0:
            errors.append(f"{src.name}: {stderr.strip()[-2000:]}")
    if errors:
        raise RuntimeError(f"{compiler} failed: " + "\n".join(errors))
    link = subprocess.run([compiler, *_FLAGS, *sorted(map(str, objects.iterdir())), "-o", out],
                          capture_output=True, text=True, timeout=300)
    if link.returncode != 0:
        raise RuntimeError(f"{compiler} failed to link: {link.stderr.strip()[-2000:]}")


def native_available() -> bool:
    """Builds/loads the kernels once per process; False (with one warning) when it cannot."""
    global _lib, _tried, _has_gemv, _has_amx
    if not _tried:
        _tried = True
        if os.environ.get("MINIVLLM_CPU_KERNEL", "1") == "0":
            return False
        try:
            _lib = _build()
            _has_gemv = bool(_lib.minivllm_has_gemv_bf16())
            _has_amx = bool(_lib.minivllm_has_gemm_amx())  # CPU has AMX and Linux granted it
        except Exception as e:  # any failure: fall back to the PyTorch paths, never crash
            logger.warning("Native CPU kernels unavailable (%s); attention uses gather + SDPA "
                           "and linears oneDNN.", e)
    return _lib is not None


def native_lib() -> NativeLibrary | None:
    """The loaded kernel library (None: unavailable), for kernel modules' own ctypes wrappers."""
    return _lib if native_available() else None


def gemv_supports_weight(weight: torch.Tensor) -> bool:
    """True when `gemv_bf16` can multiply by `weight`: bf16 [N, K] on CPU, unit-stride rows,
    K % 32 == 0, and the kernel built with AVX-512 (F + BW) or AVX2. (Layers check once, after
    loading.)"""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.stride(1) == 1 and weight.shape[1] % 32 == 0 and native_available()
            and _has_gemv)


def gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `gemv_bf16` can compute `F.linear(x, weight)`: 1..`GEMV_MAX_ROWS` bf16 rows on
    CPU."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS
            and x.device.type == "cpu" and gemv_supports_weight(weight))


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [m, K] (see `gemv_supported`); returns [m, N]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    n, k = weight.shape
    m = x.shape[0]
    y = x.new_empty(m, n)
    rc = _lib.minivllm_gemv_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                                 None if bias is None else bias.data_ptr(), y.data_ptr(),
                                 y.stride(0), m, n, k, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gemv_bf16 needs K % 32 == 0 and AVX-512 or AVX2, got K={k}")
    return y


def gemm_supports_weight(weight: torch.Tensor) -> bool:
    """True when `gemm_bf16` can multiply by `weight`: bf16 [N, K] on CPU, unit-stride rows,
    N % 16 == 0, K % 32 == 0, and AMX usable here. (Layers check once, after loading.)"""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.stride(1) == 1 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0
            and native_available() and _has_amx)


def gemm_rows(weight: torch.Tensor) -> int:
    """Up to how many rows a linear with `weight` should use `gemm_bf16` (0: never)."""
    if not gemm_supports_weight(weight):
        return 0
    return GEMM_PROMPT_ROWS if weight.numel() <= GEMM_PROMPT_WEIGHT else GEMM_MAX_ROWS


def _gemm_operands(x: torch.Tensor, bias: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x with unit-stride rows and a contiguous bf16 bias, as the AMX kernels read them."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    return x, bias


def gemm_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bf16 x [M, K], M >= 1, and a weight `gemm_supports_weight`
    accepted; returns [M, N] (fp32 accumulation, one bf16 rounding)."""
    x, bias = _gemm_operands(x, bias)
    (m, k), n = x.shape, weight.shape[0]
    y = x.new_empty(m, n)
    rc = _lib.minivllm_gemm_amx_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(),
                                     weight.stride(0), None if bias is None else bias.data_ptr(),
                                     y.data_ptr(), n, m, n, k, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gemm_bf16 needs M >= 1, N % 16 == 0, K % 32 == 0 "
                         f"and AMX (rc={rc}); got M={m}, N={n}, K={k}")
    return y


def gemm_silu_mul_bf16(x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """SiluAndMul of `F.linear(x, weight, bias)` for a gate_up weight [2d, K] (gate rows first)
    `gemm_supports_weight` accepted, d % 16 == 0, and M >= 1; returns [M, d].
    gate and up are rounded to bf16 before the activation, as the unfused ops round them."""
    x, bias = _gemm_operands(x, bias)
    (m, k), d = x.shape, weight.shape[0] // 2
    y = x.new_empty(m, d)
    rc = _lib.minivllm_gemm_amx_silu_mul_bf16(
        x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), y.data_ptr(), d, m, d, k,
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"gemm_silu_mul_bf16 needs M >= 1, d % 16 == 0, "
                         f"K % 32 == 0 and AMX (rc={rc}); got M={m}, d={d}, K={k}")
    return y


def silu_and_mul_bf16(x: torch.Tensor) -> torch.Tensor | None:
    """`silu(x[:, :d]) * x[:, d:]` for bf16 x [M, 2d] on CPU (unit-stride rows), with eager's
    roundings; None when the kernel cannot take it (then use torch)."""
    if (x.dtype != torch.bfloat16 or x.dim() != 2 or x.device.type != "cpu"
            or x.stride(-1) != 1 or x.shape[1] % 2 != 0 or not native_available()):
        return None
    m, d = x.shape[0], x.shape[1] // 2
    y = x.new_empty(m, d)
    rc = _lib.minivllm_silu_mul_bf16(x.data_ptr(), x.stride(0), y.data_ptr(), d, m, d,
                                     torch.get_num_threads())
    return y if rc == 0 else None


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """`torch.rms_norm(x, weight)` (after `x = x + residual`, returned too) for bf16 x [m, d] on
    CPU with unit-stride rows and a contiguous bf16 weight [d], with eager's roundings; None when
    the kernel cannot take it (then use torch). x may also be [T, H, d] with its H rows of d
    side by side in each token's row (a head view of a fused projection's output, no residual):
    the result is then a contiguous [T, H, d]."""
    if (x.dtype != torch.bfloat16 or x.dim() not in (2, 3) or x.device.type != "cpu"
            or x.stride(-1) != 1 or weight.dtype != torch.bfloat16 or not weight.is_contiguous()
            or weight.shape != x.shape[-1:] or not native_available()):
        return None
    group = 1 if x.dim() == 2 else x.shape[1]
    if group > 1 and (residual is not None or x.stride(1) != x.shape[2]):
        return None
    if residual is not None and (residual.dtype != torch.bfloat16 or residual.shape != x.shape
                                 or residual.stride(1) != 1):
        return None
    m, d = x.shape[0] * group, x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    new_residual = torch.empty(m, d, dtype=torch.bfloat16) if residual is not None else None
    rc = _lib.minivllm_rms_norm_bf16(
        x.data_ptr(), x.stride(0), group, None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        None if new_residual is None else new_residual.data_ptr(), weight.data_ptr(),
        out.data_ptr(), m, d, eps, torch.get_num_threads())
    if rc != 0:
        return None
    return out if residual is None else (out, new_residual)


def argmax_bf16(logits: torch.Tensor) -> torch.Tensor | None:
    """int64 [B]: first index of each row's maximum of bf16 logits [B, V] (unit stride rows);
    None when the kernel cannot take them (then use `logits.max(-1)`).

    NOTE: a NaN never wins here, where torch's max would return it.
    """
    if (logits.dtype != torch.bfloat16 or logits.dim() != 2 or logits.stride(1) != 1
            or logits.device.type != "cpu" or logits.shape[1] == 0 or not native_available()):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    rc = _lib.minivllm_argmax_bf16(logits.data_ptr(), logits.shape[0], logits.shape[1],
                                   logits.stride(0), out.data_ptr(), torch.get_num_threads())
    return out if rc == 0 else None
