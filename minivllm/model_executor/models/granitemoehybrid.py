"""IBM Granite 4.0 hybrid (Granite-4.0-H micro / tiny / small): Mamba-2 layers beside attention
layers, each followed by a MoE block plus a shared MLP, with Granite's four multipliers.

`config.layer_types` names each layer "mamba" or "attention" (transformers 5 writes
"linear_attention" / "full_attention"; both are read). A Mamba layer's mixer is minivllm's
`MambaMixer2` (`mamba`), whose conv and SSM states live in per-sequence state slots; an
attention layer is Granite's (`attention_multiplier` as the softmax scale), with RoPE only
where `position_embedding_type == "rope"` (Granite-4.0-H uses none). Every layer's
feed-forward is `block_sparse_moe(x) + shared_mlp(x)`, or the shared MLP alone when
`num_local_experts == 0` (the dense Granite-4.0-H micro). The checkpoint's `A_log` loads as
the mixer's `A = -exp(A_log)`.
"""

from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from minivllm.model_executor.layers.mamba.mamba_utils import (MambaStateDtypeCalculator,
                                                              MambaStateShapeCalculator)
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope

from .granite import GraniteAttention, GraniteForCausalLM, GraniteModel
from .granitemoe import (GRANITE_MOE_MAPPER, GraniteSparseMoeBlock, granite_moe_ffn,
                         make_shared_mlp)
from .interfaces import HasInnerState, IsHybrid, MambaStateShapes
from .llama import input_norm
from .qwen2_moe import MoeForCausalLM
from .utils import WeightsMapper, extract_layer_index

_MAMBA_TYPES = ("mamba", "linear_attention")
_ATTENTION_TYPES = ("attention", "full_attention")

GRANITE_MOE_HYBRID_MAPPER = WeightsMapper(
    orig_to_new_suffix={".mamba.A_log": ".mamba.A"}) | GRANITE_MOE_MAPPER


def granite_hybrid_layer_kind(config: Any, layer_idx: int) -> str:
    """The kind of layer `layer_idx`, "mamba" or "attention", from either spelling of
    `layer_types`."""
    kind = config.layer_types[layer_idx]
    if kind in _MAMBA_TYPES:
        return "mamba"
    if kind in _ATTENTION_TYPES:
        return "attention"
    raise ValueError(f"layer_types[{layer_idx}] must be one of "
                     f"{list(_MAMBA_TYPES + _ATTENTION_TYPES)}, got {kind!r}")


class GraniteMoeHybridAttention(GraniteAttention):
    """Granite's attention (scale `attention_multiplier`), position-free unless the config's
    `position_embedding_type` is "rope"; no sinks, no sliding window."""

    def _init_rotary_emb(self, config: Any, quant_config: QuantizationConfig | None) -> None:
        self.rotary_emb = None
        if getattr(config, "position_embedding_type", None) == "rope":
            self.rotary_emb = get_rope(self.head_dim, max_position=self.max_position_embeddings,
                                       rope_parameters=config.rope_parameters,
                                       is_neox_style=True)
        # NOTE: runs before LlamaAttention builds `self.attn`, which reads `self.scaling`.
        self.scaling = config.attention_multiplier

    def _make_sinks(self, config: Any, layer_idx: int) -> nn.Parameter | None:
        return None


class _GraniteMoeHybridLayer(nn.Module):
    """What both layer kinds share: the two pre-norms, the feed-forward (`block_sparse_moe`
    where there are experts, `shared_mlp` where its width is not 0) and the multiplier."""

    def _init_common(self, config: Any, quant_config: QuantizationConfig | None,
                     prefix: str) -> None:
        self.residual_multiplier = config.residual_multiplier
        self.block_sparse_moe = None
        if getattr(config, "num_local_experts", 0) > 0:
            self.block_sparse_moe = GraniteSparseMoeBlock(config, quant_config,
                                                  prefix=f"{prefix}.block_sparse_moe")
        self.shared_mlp = make_shared_mlp(config, quant_config, prefix)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Both branch outputs leave scaled; the next fused add + norm (or the final norm) adds
        # them to the residual: transformers' `residual + multiplier * branch(x)`.
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.mix(positions, hidden_states)                       # [T, H]
        hidden_states, residual = self.post_attention_layernorm(
            hidden_states * self.residual_multiplier, residual)
        hidden_states = granite_moe_ffn(self.block_sparse_moe, self.shared_mlp, hidden_states)
        return hidden_states * self.residual_multiplier, residual


class GraniteMoeHybridMambaDecoderLayer(_GraniteMoeHybridLayer):
    """A Mamba-2 mixer (`mamba`: in_proj -> causal conv -> SSD scan -> gated norm -> out_proj,
    its conv / SSM states in the sequence's state slot) and the feed-forward."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.mamba = MambaMixer2(
            hidden_size=config.hidden_size, ssm_state_size=config.mamba_d_state,
            conv_kernel_size=config.mamba_d_conv,
            intermediate_size=config.mamba_expand * config.hidden_size,
            use_conv_bias=config.mamba_conv_bias, use_bias=config.mamba_proj_bias,
            n_groups=config.mamba_n_groups, num_heads=config.mamba_n_heads,
            head_dim=config.mamba_d_head, rms_norm_eps=config.rms_norm_eps,
            activation=config.hidden_act, model_config=vllm_config.model_config,
            cache_config=vllm_config.cache_config, quant_config=quant_config,
            prefix=f"{prefix}.mamba")
        self._init_common(config, quant_config, prefix)

    def mix(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mamba(hidden_states)


class GraniteMoeHybridAttentionDecoderLayer(_GraniteMoeHybridLayer):
    """Granite's attention (`self_attn`, a KV cache) and the feed-forward."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        bias = getattr(config, "attention_bias", False)
        self.self_attn = GraniteMoeHybridAttention(
            config=config, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings, quant_config=quant_config,
            bias=bias, bias_o_proj=bias, cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn")
        self._init_common(config, quant_config, prefix)

    def mix(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.self_attn(positions=positions, hidden_states=hidden_states)


ALL_DECODER_LAYER_TYPES = {"mamba": GraniteMoeHybridMambaDecoderLayer,
                           "attention": GraniteMoeHybridAttentionDecoderLayer}


def granite_moe_hybrid_layer(vllm_config: VllmConfig, prefix: str = "") -> nn.Module:
    """The layer at `prefix` ("...layers.3"), of the kind `layer_types` gives it."""
    config = vllm_config.model_config.hf_config
    kind = granite_hybrid_layer_kind(config, extract_layer_index(prefix))
    return ALL_DECODER_LAYER_TYPES[kind](vllm_config=vllm_config, prefix=prefix)


class GraniteMoeHybridModel(GraniteModel):
    """Granite's model body (embedding multiplier, final norm) on the hybrid layers."""

    hf_to_vllm_mapper = GRANITE_MOE_HYBRID_MAPPER

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: Any = granite_moe_hybrid_layer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class GraniteMoeHybridForCausalLM(GraniteForCausalLM, HasInnerState, IsHybrid):
    """Granite 4.0 hybrid with its LM head (logits / `logits_scaling`); state slots for the
    Mamba layers; LoRA, PP and quantization as Llama."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "conv1d": ["conv1d"], "in_proj": ["in_proj"],
                              "input_linear": ["input_linear"]}
    hf_to_vllm_mapper = GRANITE_MOE_HYBRID_MAPPER
    get_expert_mapping = MoeForCausalLM.get_expert_mapping

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: Any = granite_moe_hybrid_layer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: Any = granite_moe_hybrid_layer) -> nn.Module:
        return GraniteMoeHybridModel(vllm_config=vllm_config, prefix=prefix,
                                     layer_type=layer_type)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig
                                          ) -> tuple[torch.dtype, torch.dtype]:
        """(conv state dtype, SSM state dtype) of every Mamba layer."""
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.mamba2_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> MambaStateShapes:
        """Per Mamba layer and state slot, this TP rank's conv state [K - 1, conv channels] and
        SSM state [heads, head_dim, d_state]."""
        config = vllm_config.model_config.hf_config
        return MambaStateShapeCalculator.mamba2_state_shape(
            vllm_config.parallel_config.tensor_parallel_size,
            config.mamba_expand * config.hidden_size, config.mamba_n_groups,
            config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state,
            config.mamba_d_conv)


__all__ = ["ALL_DECODER_LAYER_TYPES", "GRANITE_MOE_HYBRID_MAPPER", "GraniteMoeHybridAttention",
           "GraniteMoeHybridAttentionDecoderLayer", "GraniteMoeHybridForCausalLM",
           "GraniteMoeHybridMambaDecoderLayer", "GraniteMoeHybridModel",
           "granite_hybrid_layer_kind", "granite_moe_hybrid_layer"]
