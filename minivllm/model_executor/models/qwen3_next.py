"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet linear-attention layers and gated
full-attention layers, each followed by a sparse MoE block with a gated shared expert.

`config.layer_types` names each layer "linear_attention" (the shared
`QwenGatedDeltaNetAttention`, whose per-sequence conv + recurrent state lives in state slots) or
"full_attention" (Qwen3's attention with q_proj doubled: each head's q is followed by an output
gate, `out = o_proj(attn(q, k, v) * sigmoid(gate))`; partial RoPE). Every RMSNorm here is
zero-centred: the checkpoint stores w and the scale is (1 + w) (`GemmaRMSNorm`). The MTP
(multi-token prediction) weights under `mtp.` belong to a draft model and are skipped.
"""

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.distributed import get_pp_group
from minivllm.model_executor.layers.layernorm import GemmaRMSNorm
from minivllm.model_executor.layers.linear import QKVParallelLinear
from minivllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention)
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope

from .interfaces import HasInnerState, IsHybrid, MixtureOfExperts
from .llama import LlamaMLP, LlamaModel, input_norm
from .qwen2_moe import EXPERT_NAMES_MAPPER, MoeForCausalLM, SparseMoeBlock, is_sparse_layer
from .qwen3 import Qwen3Attention, apply_qk_norm
from .utils import AutoWeightsLoader, WeightsMapper, extract_layer_index

# Multi-token-prediction heads (a draft model's weights) ride along in the checkpoints.
MTP_SKIPPER = WeightsMapper(orig_to_new_prefix={"mtp.": None})
_LAYER_TYPES = ("linear_attention", "full_attention")


def text_rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as plain (text) RoPE.

    Qwen3.5's M-RoPE gives every rotary frequency one of three position axes; a text token has
    the same position on all three, so dropping `mrope_section` / `mrope_interleaved` leaves
    the same rotation. A top-level `partial_rotary_factor` (older configs) is folded in."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    for key in ("mrope_section", "mrope_interleaved"):
        params.pop(key, None)
    if "partial_rotary_factor" not in params and getattr(config, "partial_rotary_factor", None):
        params["partial_rotary_factor"] = config.partial_rotary_factor
    return params


class Qwen3NextAttention(Qwen3Attention):
    """Qwen3's attention with an output gate and (1 + w) QK-norms.

    q_proj's checkpoint rows are per head `[q_h (d) | gate_h (d)]`, so the fused projection
    holds 2 * num_heads "heads" of q: a contiguous TP split keeps each pair on one rank."""

    def __init__(self, config: Any, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        prefix = kwargs.get("prefix", "")
        del self.qkv_proj                                # rebuilt with the gate rows beside q
        self.qkv_proj = QKVParallelLinear(
            hidden_size=self.hidden_size, head_size=self.head_dim,
            total_num_heads=2 * self.total_num_heads, total_num_kv_heads=self.total_num_kv_heads,
            bias=kwargs.get("bias", False), quant_config=kwargs.get("quant_config"),
            prefix=f"{prefix}.qkv_proj")
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _init_rotary_emb(self, config: Any, quant_config: QuantizationConfig | None) -> None:
        self.rotary_emb = get_rope(self.head_dim, max_position=self.max_position_embeddings,
                                   rope_parameters=text_rope_parameters(config),
                                   is_neox_style=True)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv, _ = self.qkv_proj(hidden_states)            # [T, 2 q_size + 2 kv_size]
        q_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [T, nH, 2d] -> q, gate [T, nH, d] each, flattened back to [T, q_size]
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q, gate = q.reshape(num_tokens, -1), gate.reshape(num_tokens, -1)
        q, k = apply_qk_norm(q, k, self.q_norm, self.k_norm, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v) * torch.sigmoid(gate)     # [T, q_size]
        output, _ = self.o_proj(attn_output)                        # [T, H]
        return output


class Qwen3NextDecoderLayer(nn.Module):
    """input_layernorm -> linear or full attention -> post_attention_layernorm -> MLP (the
    residual outside the norms). Subclasses pick the GDN projection layout and the MLP."""

    gqa_interleaved_layout = True          # Qwen3-Next's in_proj_qkvz / in_proj_ba, per key head

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config: Any = None) -> None:
        super().__init__()
        config = config or vllm_config.model_config.hf_text_config
        quant_config = vllm_config.quant_config
        layer_idx = extract_layer_index(prefix)
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = QwenGatedDeltaNetAttention(
                config, vllm_config, prefix=f"{prefix}.linear_attn",
                gqa_interleaved_layout=self.gqa_interleaved_layout)
        elif self.layer_type == "full_attention":
            self.self_attn = Qwen3NextAttention(
                config, hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                max_position_embeddings=config.max_position_embeddings,
                quant_config=quant_config, bias=getattr(config, "attention_bias", False),
                bias_o_proj=getattr(config, "attention_bias", False),
                cache_config=vllm_config.cache_config, prefix=f"{prefix}.self_attn")
        else:
            raise ValueError(f"layer_types[{layer_idx}] must be one of {list(_LAYER_TYPES)}, "
                             f"got {self.layer_type!r}")
        self.mlp = self.make_mlp(config, layer_idx, quant_config, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_mlp(self, config: Any, layer_idx: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        """Qwen-MoE's rule (`decoder_sparse_step`, `mlp_only_layers`): the sparse block with its
        gated shared expert, else a dense SwiGLU MLP."""
        if is_sparse_layer(config, layer_idx, config.num_experts):
            return qwen_next_moe(config, config.norm_topk_prob, quant_config, prefix)
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                        quant_config=quant_config, prefix=prefix)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        if self.layer_type == "linear_attention":
            hidden_states = self.linear_attn(hidden_states)
        else:
            hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def qwen_next_moe(config: Any, renormalize: bool, quant_config: QuantizationConfig | None,
                  prefix: str) -> SparseMoeBlock:
    """Router -> top-k of `num_experts` routed experts, plus the sigmoid-gated shared expert."""
    return SparseMoeBlock(config, config.num_experts, config.moe_intermediate_size, renormalize,
                          quant_config, prefix, config.shared_expert_intermediate_size)


class Qwen3NextModel(LlamaModel):
    """Llama's model body on the hybrid layers, with a (1 + w) final norm."""

    hf_to_vllm_mapper = EXPERT_NAMES_MAPPER | LlamaModel.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Qwen3NextDecoderLayer) -> None:
        config = vllm_config.model_config.hf_text_config
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        if get_pp_group().is_last_rank:
            self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class QwenNextMixtureOfExperts(MixtureOfExperts):
    """vLLM's MoE bookkeeping for the Qwen-Next family: experts are placed once (no EPLB), so
    physical experts equal logical ones; the shared expert is not counted, as in vLLM."""

    def set_moe_parameters(self) -> None:
        self.expert_weights = []
        self.moe_layers = [layer.mlp.experts for layer in self.model.layers
                           if isinstance(getattr(layer, "mlp", None), SparseMoeBlock)]
        config = self.config
        self.num_moe_layers = len(self.moe_layers)
        self.num_expert_groups = 1
        self.num_shared_experts = 0
        self.num_logical_experts = self.num_physical_experts = config.num_experts
        self.num_local_physical_experts = self.num_routed_experts = config.num_experts
        self.num_redundant_experts = 0


class Qwen3NextForCausalLM(MoeForCausalLM, HasInnerState, IsHybrid, QwenNextMixtureOfExperts):
    """Qwen3-Next with an LM head; PP, LoRA as Llama; state slots for the GDN layers."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"],
                              "in_proj_qkvz": ["in_proj_qkvz"], "in_proj_ba": ["in_proj_ba"]}
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
    model_cls = Qwen3NextModel
    layer_cls = Qwen3NextDecoderLayer
    hf_to_vllm_mapper = MTP_SKIPPER | Qwen3NextModel.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.set_moe_parameters()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Applied here: the model body's own mapper sees names without `model.`.
        return AutoWeightsLoader(self).load_weights(weights, mapper=MTP_SKIPPER)


__all__ = ["MTP_SKIPPER", "Qwen3NextAttention", "Qwen3NextDecoderLayer", "Qwen3NextForCausalLM",
           "Qwen3NextModel", "QwenNextMixtureOfExperts", "qwen_next_moe", "text_rope_parameters"]
