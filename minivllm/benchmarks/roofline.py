"""The decode-step floor the memory allows: GGUF weight bytes streamed per step / measured read bandwidth."""

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
    buf.sum()        # warm-up: torch's thread pool starts
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * buf.element_size() / min(times)


def decode_weight_bytes(path: str) -> int:
    """Bytes of the weights one decode step streams: every tensor once, as stored in the file.

    With an untied LM head (`output.weight`) the embedding table is only gathered (one row per
    token, negligible) and is left out; a tied table is read whole as the LM head, once.
    """
    tensors = open_gguf(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))
