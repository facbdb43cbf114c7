"""KV-cache specs at vLLM's path (`v1.kv_cache_interface`): what one layer needs per block.

minivllm's runner sizes each layer's cache from the layer itself (`get_kv_cache_shape`); these
specs describe the same geometry in vLLM's terms for files that build or return them.
"""

import enum
from dataclasses import dataclass

import torch


class SparseCacheRole(enum.Enum):
    """Which cache of a sparse-attention layer a spec describes (DeepSeek-V3.2's indexer)."""

    MAIN = "main"
    INDEXER = "indexer"


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        # keys and values
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """One latent row per token (no separate values): half an AttentionSpec's page."""

    max_tp_shards: int = 1
    cache_dtype_str: str | None = None
    cache_role: SparseCacheRole = SparseCacheRole.MAIN

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize
