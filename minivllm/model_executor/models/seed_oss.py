"""ByteDance Seed-OSS: Llama with q / k / v biases and an o_proj bias of its own.

`attention_bias` (default True) gives q / k / v their biases; `attention_out_bias` (default
False) decides the o_proj bias, where Llama ties both to `attention_bias`. `head_dim` is explicit
(128 in the released checkpoints, so `num_heads * head_dim` need not equal the hidden size).
The attention / residual dropouts only act in training.
"""

from torch import nn

from minivllm.config import VllmConfig

from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class SeedOssAttention(LlamaAttention):
    """Llama attention whose o_proj bias follows `config.attention_out_bias`."""

    def __init__(self, config, *args, bias_o_proj: bool = False, **kwargs) -> None:
        # LlamaDecoderLayer passes `bias_o_proj = attention_bias`; Seed-OSS has its own flag.
        out_bias = bool(getattr(config, "attention_out_bias", False))
        super().__init__(config, *args, bias_o_proj=out_bias, **kwargs)


class SeedOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None,
                 attn_layer_type: type[nn.Module] = SeedOssAttention) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)


class SeedOssForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = SeedOssDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
