"""The attention layers a model file builds: `Attention`, `ChunkedLocalAttention`,
`EncoderOnlyAttention`, MLA's `MLAAttention`, vLLM's `RSWAAttention` and the prefix-LM
`PrefillPrefixLMAttention`."""

from minivllm.model_executor.layers.attention.attention import Attention
from minivllm.model_executor.layers.attention.chunked_local_attention import ChunkedLocalAttention
from minivllm.model_executor.layers.attention.encoder_only_attention import EncoderOnlyAttention
from minivllm.model_executor.layers.attention.mla_attention import MLAAttention
from minivllm.model_executor.layers.attention.prefill_prefix_lm_attention import (
    PrefillPrefixLMAttention)
from minivllm.model_executor.layers.attention.rswa_attention import RSWAAttention

__all__ = ["Attention", "ChunkedLocalAttention", "EncoderOnlyAttention", "MLAAttention",
           "PrefillPrefixLMAttention", "RSWAAttention"]
