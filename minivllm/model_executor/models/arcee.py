"""Arcee (AFM-4.5B): Llama whose MLP is not gated, `down(relu(up(x)) ** 2)`.

Attention, norms, RoPE and the LM head are Llama's. The MLP has no gate_proj, so the checkpoint's
`up_proj` loads as itself: the name mapper stacks q / k / v only (Llama's would fold `up_proj`
into a `gate_up_proj` that does not exist here). The activation comes from `hidden_act`
("relu2" in the released checkpoints); Apertus reuses this MLP with xIELU.
"""

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.activation import get_act_fn
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.v1.attention.backend import AttentionType

from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .utils import WeightsMapper

# q / k / v fold into qkv_proj; up_proj and down_proj load under their own names.
QKV_ONLY_MAPPER = WeightsMapper(orig_to_new_stacked={
    ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v")})


class ArceeMLP(nn.Module):
    """up (column) -> act -> down (row); no gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 quant_config: QuantizationConfig | None = None, bias: bool = False,
                 prefix: str = "", reduce_results: bool = True) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias,
                                            quant_config=quant_config, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                           quant_config=quant_config, reduce_results=reduce_results,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = get_act_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.up_proj(x)              # [T, I / TP]
        x, _ = self.down_proj(self.act_fn(x))   # [T, H], all-reduced
        return x


def make_attention(vllm_config: VllmConfig, config, prefix: str,
                   attn_layer_type: type[nn.Module] = LlamaAttention) -> nn.Module:
    """Llama attention as transformers' Llama builds it: q / k / v and o_proj biases all follow
    `attention_bias`; causal unless the config says `is_causal=False`."""
    bias = bool(getattr(config, "attention_bias", False))
    causal = getattr(config, "is_causal", True)
    return attn_layer_type(
        config=config, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
        quant_config=vllm_config.quant_config, bias=bias, bias_o_proj=bias,
        cache_config=vllm_config.cache_config, prefix=f"{prefix}.self_attn",
        attn_type=AttentionType.DECODER if causal else AttentionType.ENCODER_ONLY)


class ArceeDecoderLayer(nn.Module):
    """Llama's pre-norm block (fused add + RMSNorm on the residual stream) with `ArceeMLP`."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None) -> None:
        super().__init__()
        config = config or vllm_config.model_config.hf_config
        self.self_attn = make_attention(vllm_config, config, prefix)
        self.mlp = ArceeMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant_config=vllm_config.quant_config,
                            bias=getattr(config, "mlp_bias", False), prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # Llama's pre-norm block over the same attributes (only the MLP inside differs).
    forward = LlamaDecoderLayer.forward


class ArceeModel(LlamaModel):
    hf_to_vllm_mapper = QKV_ONLY_MAPPER

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = ArceeDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class ArceeForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    hf_to_vllm_mapper = QKV_ONLY_MAPPER

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = ArceeDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = ArceeDecoderLayer) -> nn.Module:
        return ArceeModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
