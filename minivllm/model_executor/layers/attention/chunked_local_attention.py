"""`ChunkedLocalAttention` (vLLM's layer for Llama 4's RoPE layers): causal attention limited to
fixed-size chunks of positions. A query at position p sees the keys at positions
[p // C * C, p], C = `attention_chunk_size`: the first token of each chunk sees only itself.

vLLM splits every sequence into virtual per-chunk sequences for its GPU kernels; here the CPU
backend masks (`AttnGroup.build_mask(chunk=C)`) on the prompt, chunked-prefill and decode paths
alike. The whole KV cache is kept (no block of an earlier chunk is freed early).
"""

from typing import Any

from minivllm.config import CacheConfig
from minivllm.model_executor.layers.attention.attention import Attention


class ChunkedLocalAttention(Attention):
    """`Attention` whose queries attend within their own `attention_chunk_size` block."""

    def __init__(self, num_heads: int, head_size: int, scale: float, attention_chunk_size: int,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 cache_config: CacheConfig | None = None, quant_config: Any = None,
                 kv_sharing_target_layer_name: str | None = None, prefix: str = "") -> None:
        if not isinstance(attention_chunk_size, int) or attention_chunk_size <= 0:
            raise ValueError(f"attention_chunk_size must be a positive int, got "
                             f"{attention_chunk_size!r}")
        self.attention_chunk_size = attention_chunk_size
        # NOTE: no sliding window beside the chunks (vLLM's layer takes none either).
        super().__init__(num_heads, head_size, scale, num_kv_heads=num_kv_heads,
                         alibi_slopes=alibi_slopes, cache_config=cache_config,
                         quant_config=quant_config, per_layer_sliding_window=None,
                         prefix=prefix,
                         kv_sharing_target_layer_name=kv_sharing_target_layer_name,
                         attention_chunk_size=attention_chunk_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, attention_chunk_size={self.attention_chunk_size}"
