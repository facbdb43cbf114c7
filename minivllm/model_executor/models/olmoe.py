"""OLMoE: Llama's pre-norm blocks with OLMo 2's QK-norm over all heads, optional `clip_qkv`,
and a sparse MoE block on every layer (softmax top-k, renormalised per `norm_topk_prob`)."""

from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.quantization import QuantizationConfig

from .llama import LlamaModel
from .olmo2 import Olmo2Attention
from .qwen2_moe import EXPERT_NAMES_MAPPER, MoeDecoderLayer, MoeForCausalLM, SparseMoeBlock


class OlmoeAttention(Olmo2Attention):
    """QK-norm over every head (gathered under TP), then q, k and v clamped to +-clip_qkv."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clip_qkv = getattr(kwargs["config"], "clip_qkv", None)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)              # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._apply_qk_norm(q, k)
        if self.clip_qkv is not None:                      # after the norm, as OLMoE's reference
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))        # [T, H]
        return output


class OlmoeDecoderLayer(MoeDecoderLayer):
    """OLMoE attention + a sparse block on every layer."""

    attn_cls = OlmoeAttention
    every_layer_sparse = True

    def make_moe(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        return SparseMoeBlock(config, config.num_experts, config.intermediate_size,
                              config.norm_topk_prob, quant_config, prefix)


class OlmoeModel(LlamaModel):
    hf_to_vllm_mapper = EXPERT_NAMES_MAPPER | LlamaModel.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = OlmoeDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE with an LM head; LoRA, PP as Llama."""

    model_cls = OlmoeModel
    layer_cls = OlmoeDecoderLayer
    hf_to_vllm_mapper = OlmoeModel.hf_to_vllm_mapper


__all__ = ["OlmoeAttention", "OlmoeDecoderLayer", "OlmoeForCausalLM", "OlmoeModel"]
