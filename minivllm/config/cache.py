"""CacheConfig: the paged KV cache's geometry and budget."""

from dataclasses import dataclass

# Recurrent-state caches take these; the paged KV cache also vLLM's fp8 names (fp8 = fp8_e4m3).
MAMBA_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
CACHE_DTYPES = MAMBA_CACHE_DTYPES + ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class CacheConfig:
    block_size: int = 16                     # tokens per KV block
    cache_dtype: str = "auto"                # "auto" = the model dtype
    enable_prefix_caching: bool = True       # hash-chained reuse of full blocks (vLLM v1 default)
    num_gpu_blocks_override: int | None = None   # fix the number of blocks (tests force preemption)
    # KV budget per rank; None: VLLM_CPU_KVCACHE_SPACE GiB on CPU if set, else 1 GiB
    kv_cache_memory_bytes: int | None = None
    sliding_window: int | None = None        # model-wide window, if the config asks for one
    # Recurrent-state layers (Mamba, short conv): their conv state, and Mamba's SSM state.
    mamba_cache_dtype: str = "auto"          # "auto" = the model dtype
    mamba_ssm_cache_dtype: str = "auto"      # "auto" = mamba_cache_dtype's
    # vLLM's: on CUDA, the share of the GPU's memory the engine may fill (the KV cache gets what
    # the weights leave) when kv_cache_memory_bytes is not set; CPU budgets ignore it.
    gpu_memory_utilization: float = 0.9
    # vLLM's YOCO fast prefill (KV-sharing layers skip prompt tokens): not provided, False only.
    kv_sharing_fast_prefill: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}")
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            if getattr(self, name) not in MAMBA_CACHE_DTYPES:
                raise ValueError(f"{name} must be one of {MAMBA_CACHE_DTYPES}, "
                                 f"got {getattr(self, name)!r}")
        if self.kv_sharing_fast_prefill:
            raise NotImplementedError("kv_sharing_fast_prefill is not supported: KV-sharing "
                                      "layers run every prompt token; leave it False")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be >= 1")
