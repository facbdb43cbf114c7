"""`EncoderOnlyAttention`: bidirectional attention within each sequence, without a KV cache.

qwen3.py imports `Attention` from this module too, so it is re-exported here.
"""

from typing import Any

from minivllm.config import CacheConfig
from minivllm.model_executor.layers.attention.attention import Attention
from minivllm.v1.attention.backend import AttentionType

__all__ = ["Attention", "EncoderOnlyAttention"]


class EncoderOnlyAttention(Attention):
    """Non-causal attention among a sequence's own tokens (embedding models); no KV cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 cache_config: CacheConfig | None = None, attn_type: str | None = None,
                 **kwargs: Any) -> None:
        if attn_type is not None:
            assert attn_type == AttentionType.ENCODER_ONLY, (
                "EncoderOnlyAttention only supports AttentionType.ENCODER_ONLY")
        super().__init__(num_heads, head_size, scale, cache_config=cache_config,
                         attn_type=AttentionType.ENCODER_ONLY, **kwargs)
