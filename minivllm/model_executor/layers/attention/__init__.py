"""The attention layers a model file builds: `Attention` and `EncoderOnlyAttention`."""

from minivllm.model_executor.layers.attention.attention import Attention
from minivllm.model_executor.layers.attention.encoder_only_attention import EncoderOnlyAttention

__all__ = ["Attention", "EncoderOnlyAttention"]
