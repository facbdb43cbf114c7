"""How many bytes a rank's paged KV cache may take when no budget is given."""

import torch

from minivllm import envs

_DEFAULT_KV_BYTES = 1 << 30   # 1 GiB per rank when neither a byte budget nor a block count is set


def default_kv_bytes(device: torch.device, gpu_memory_utilization: float = 0.9) -> int:
    """The KV budget without --kv-cache-memory-bytes: on CPU vLLM's VLLM_CPU_KVCACHE_SPACE (GiB)
    where set and not 0, else `_DEFAULT_KV_BYTES`; on CUDA, what `gpu_memory_utilization` of
    the GPU's memory leaves once the weights (and all else now held) are counted."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(gpu_memory_utilization * total) - (total - free)
        if budget <= 0:
            raise ValueError(f"No GPU memory left for the KV cache: {(total - free) / 2**30:.2f} "
                             f"GiB are in use, gpu_memory_utilization={gpu_memory_utilization} "
                             f"allows {gpu_memory_utilization * total / 2**30:.2f} GiB; raise it "
                             "or set kv_cache_memory_bytes")
        return budget
    gib = envs.VLLM_CPU_KVCACHE_SPACE if device.type == "cpu" else 0
    return int(gib * (1 << 30)) or _DEFAULT_KV_BYTES
