"""`HpcRopeNorm`: vLLM's fused RoPE + QK-RMSNorm + KV-cache write, a kernel of its HPC attention
backend (CUDA, head_dim 128). minivllm has no HPC backend, so `support()` is False and model
files (HunYuan V3) take their unfused path: their own q / k norms, `get_rope` and `Attention`.
Building the layer anyway is refused."""

from enum import IntEnum
from typing import Any

from torch import nn


class QkNormPolicy(IntEnum):
    """Where the fused kernel puts QK-RMSNorm relative to RoPE (vLLM's kernel ABI values)."""

    NONE = 0                 # RoPE only
    ROPE_THEN_NORM = 1
    NORM_THEN_ROPE = 2       # HunYuan V3


class HpcRopeNorm(nn.Module):
    """Never built here: `support(...)` is False on every configuration."""

    @classmethod
    def support(cls, num_heads: int, num_kv_heads: int, head_dim: int,
                kv_cache_dtype: str) -> bool:
        """Whether the fused kernel can serve this layer: only with vLLM's HPC attention
        backend, which minivllm does not have."""
        return False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("HpcRopeNorm needs vLLM's HPC attention backend (CUDA); "
                                  "check HpcRopeNorm.support() and use the unfused path")
