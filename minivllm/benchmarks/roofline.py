"""The floors the machine allows: for a decode step, GGUF weight bytes streamed per step / measured
read bandwidth; for compute-bound work, multiply-adds / the measured rate of a large GEMM."""

import re
import time

import torch

from minivllm.transformers_utils.gguf_file import open_gguf


def bandwidth_floor(model_path: str, bandwidth: float | None = None) -> dict:
    """The decode step time that weight streaming alone costs: GGUF weight bytes / read bandwidth
    (bytes/s; measured now when not given). KV-cache reads and activations come on top."""
    weight_bytes = decode_weight_bytes(model_path)
    bandwidth = measure_read_bandwidth() if bandwidth is None else bandwidth
    floor_s = weight_bytes / bandwidth
    return {"weight_bytes_per_step": weight_bytes, "read_bandwidth_gb_per_s": bandwidth / 1e9,
            "floor_ms_per_step": floor_s * 1e3, "max_decode_tokens_per_second": 1.0 / floor_s,
            "torch_num_threads": torch.get_num_threads()}


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s that torch's threads read from DRAM: the best of `repeats` sums over a buffer far
    larger than any cache (a decode step, too, only reads its weights)."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)   # written: every page is resident
    # (the warm-up call also starts torch's thread pool)
    return buf.numel() * buf.element_size() / _best_time(buf.sum, repeats)


def measure_gemm_rate(dtype: torch.dtype = torch.bfloat16, m: int = 1024, n: int = 4096,
                      k: int = 2048, repeats: int = 3) -> float:
    """Multiply-adds/s of a large `F.linear` in `dtype` (x [m, k], W [n, k]) on torch's threads:
    the rate compute-bound work in that dtype can reach here (best of `repeats` after a warm-up)."""
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    return m * n * k / _best_time(lambda: torch.nn.functional.linear(x, w), repeats)


def measure_gguf_gemm_rate(type_name: str, m: int = 64, n: int = 4096, k: int = 2048,
                           repeats: int = 3) -> float:
    """Multiply-adds/s of the packed GGUF kernel (`gguf_linear`, int8 on CPUs with VNNI or AVX2)
    on a random [n, k] weight of `type_name` times m rows, laid out as a loaded weight is. A
    K-quant mix (Q4_K_M, Q3_K_S, ...) is timed on its main type (Q4_K, Q3_K, ...)."""
    from gguf import GGMLQuantizationType

    from minivllm.model_executor.kernels.gguf_linear import gguf_linear, gguf_repack_for_cpu

    qtype = GGMLQuantizationType[_MIX_SUFFIX.sub("", type_name)]
    packed = random_gguf_blocks(qtype, n, k)
    kernel_type = gguf_repack_for_cpu(packed, int(qtype))
    x = torch.randn(m, k, dtype=torch.bfloat16)
    # independent_rows: the kernels a batched decode step runs on any row count
    run = lambda: gguf_linear(x, packed, kernel_type, None, independent_rows=True)  # noqa: E731
    return m * n * k / _best_time(run, repeats)


def random_gguf_blocks(qtype, n: int, k: int) -> torch.Tensor:
    """uint8 [n, k / block * block_bytes]: a random weight in `qtype`. Legacy types go through
    gguf-py's quantizer; K-quants (which it cannot write) are random bytes whose fp16 super-block
    scales are set to small finite values, so the kernel's float work is what a real file costs."""
    import numpy as np
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES

    from minivllm.model_executor.kernels.gguf_dequant import K_SCALE_OFFSETS

    rng = np.random.default_rng(0)
    if qtype.name not in K_SCALE_OFFSETS:
        values = rng.standard_normal((n, k), dtype=np.float32) * 0.02
        return torch.from_numpy(np.ascontiguousarray(quants.quantize(values, qtype)))
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // block, block_bytes), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype.name]:       # d (and dmin): fp16 at these byte offsets
        blocks[:, offset:offset + 2] = np.full(len(blocks), 1e-3, np.float16).view(
            np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


# A K-quant mix's size suffix (llama-quantize's _S / _M / _L choose which tensors get more bits).
_MIX_SUFFIX = re.compile(r"_[SML]$")


def _best_time(fn, repeats: int) -> float:
    """The least of `repeats` timed calls of fn, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_weight_bytes(path: str) -> int:
    """Bytes of the weights one decode step streams: every tensor once, as stored in the file.

    With an untied LM head (`output.weight`) the embedding table is only gathered (one row per
    token, negligible) and is left out; a tied table is read whole as the LM head, once.
    """
    tensors = open_gguf(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))
