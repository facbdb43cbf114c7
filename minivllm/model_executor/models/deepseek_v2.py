"""DeepSeek-V2 / V3 (also Kimi-K2, Moonlight, GLM-4.7-Flash): multi-head latent attention and a fine-grained MoE.

Each layer attends through MLA (`layers/mla.py`: queries through an optional low-rank
`q_a_proj` -> `q_b_proj`, keys and values compressed into one cached latent row per token) and,
from layer `first_k_dense_replace` on, every `moe_layer_freq`-th layer, routes each token to
`num_experts_per_tok` of `n_routed_experts` experts plus `n_shared_experts` always-on ones:
V2 scores with a softmax (optionally top-k within the best groups), V3 with a sigmoid whose
choice is steered by `e_score_correction_bias`; both scale the routed sum by
`routed_scaling_factor`. The rest is Llama's block.
"""

from typing import Any

import torch
from torch import nn

from minivllm.config import CacheConfig, VllmConfig
from minivllm.distributed import get_tensor_model_parallel_world_size
from minivllm.model_executor.layers.fused_moe import FusedMoE, GateLinear
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear, ReplicatedLinear,
                                                   RowParallelLinear)
from minivllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope
from minivllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale
from minivllm.model_executor.parameter import default_weight_loader, set_weight_attrs

from .llama import LlamaMLP, LlamaModel
from .qwen2_moe import EXPERT_NAMES_MAPPER, MoeDecoderLayer, MoeForCausalLM
from .utils import WeightsMapper

# Shared experts and dense MLPs stack gate / up; experts were renamed to w1 / w3 before this.
_MLP_STACKING = WeightsMapper(orig_to_new_stacked={
    ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)})
# With a low-rank query, both down-projections of the hidden state run as one GEMM.
_FUSED_QKV_A = WeightsMapper(orig_to_new_stacked={
    ".q_a_proj": (".fused_qkv_a_proj", 0), ".kv_a_proj_with_mqa": (".fused_qkv_a_proj", 1)})


def mla_softmax_scale(config: Any, qk_head_dim: int) -> float:
    """1/sqrt(Dn + R), times YaRN's mscale(factor, mscale_all_dim)^2 when the RoPE is scaled
    (DeepSeek's reference folds it into the whole q.k product, not only the rotary part)."""
    scale = qk_head_dim ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        mscale = yarn_get_mscale(params["factor"], params["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


class DeepseekV2MLAAttention(nn.Module):
    """MLA for this TP rank's heads: hidden [T, H] -> [T, H] (all-reduced)."""

    def __init__(self, config: Any, hidden_size: int, num_heads: int,
                 max_position_embeddings: int = 8192,
                 quant_config: QuantizationConfig | None = None, bias: bool = False,
                 cache_config: CacheConfig | None = None, prefix: str = "",
                 **unused: Any) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        if num_heads % tp_size:
            raise ValueError(f"num_attention_heads ({num_heads}) must be divisible by the "
                             f"tensor parallel size ({tp_size})")
        self.num_local_heads = num_heads // tp_size
        nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        v_dim, q_rank, kv_rank = config.v_head_dim, config.q_lora_rank, config.kv_lora_rank
        qk_dim = nope + rope
        self.fused_qkv_a_proj = self.kv_a_proj_with_mqa = None
        self.q_a_layernorm = self.q_b_proj = self.q_proj = None
        if q_rank is not None:
            self.fused_qkv_a_proj = MergedColumnParallelLinear(
                hidden_size, [q_rank, kv_rank + rope], bias=bias, quant_config=quant_config,
                disable_tp=True, prefix=f"{prefix}.fused_qkv_a_proj")
            self.q_a_layernorm = RMSNorm(q_rank, eps=config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(q_rank, num_heads * qk_dim, bias=False,
                                                 quant_config=quant_config,
                                                 prefix=f"{prefix}.q_b_proj")
        else:
            self.kv_a_proj_with_mqa = ReplicatedLinear(
                hidden_size, kv_rank + rope, bias=bias, quant_config=quant_config,
                prefix=f"{prefix}.kv_a_proj_with_mqa")
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * qk_dim, bias=False,
                                               quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
        self.kv_a_layernorm = RMSNorm(kv_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(kv_rank, num_heads * (nope + v_dim), bias=False,
                                              quant_config=quant_config,
                                              prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(num_heads * v_dim, hidden_size, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        # DeepSeek rotates adjacent pairs (GPT-J style), not NeoX halves.
        self.rotary_emb = get_rope(rope, max_position=max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None),
                                   is_neox_style=False)
        modules = MLAModules(
            kv_a_layernorm=self.kv_a_layernorm, kv_b_proj=self.kv_b_proj,
            rotary_emb=self.rotary_emb, o_proj=self.o_proj,
            fused_qkv_a_proj=self.fused_qkv_a_proj, kv_a_proj_with_mqa=self.kv_a_proj_with_mqa,
            q_a_layernorm=self.q_a_layernorm, q_b_proj=self.q_b_proj, q_proj=self.q_proj,
            indexer=None, is_sparse=False, topk_indices_buffer=None)
        self.mla_attn = MultiHeadLatentAttentionWrapper(
            hidden_size, self.num_local_heads, mla_softmax_scale(config, qk_dim), nope, rope,
            v_dim, q_rank, kv_rank, modules, cache_config, quant_config, prefix)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                llama_4_scaling: torch.Tensor | None = None) -> torch.Tensor:
        """`llama_4_scaling` [T, 1, 1] scales the queries (vLLM's signature: vLLM files built on
        this class, such as longcat_flash.py, pass it)."""
        return self.mla_attn(positions, hidden_states, llama_4_scaling)


def _routing(config: Any) -> tuple[str, str]:
    """(topk_method, scoring_func): V3 configs may leave both out (transformers' V3 always
    routes with sigmoid scores and the correction bias), V2 ones mean greedy softmax."""
    v3 = getattr(config, "model_type", "") in ("deepseek_v3", "kimi_k2", "glm4_moe_lite")
    topk_method = getattr(config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
    scoring_func = getattr(config, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"Unsupported topk_method {topk_method!r} (config field topk_method); "
                         "choose one of greedy, group_limited_greedy, noaux_tc")
    return topk_method, scoring_func


class DeepseekV2MoE(nn.Module):
    """Gate (+ V3's correction bias) -> routed experts, plus shared experts: [T, H] -> [T, H]."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Unsupported activation: {config.hidden_act} (config field "
                             "hidden_act); DeepSeek's MoE supports silu only")
        num_experts = config.n_routed_experts
        topk_method, scoring_func = _routing(config)
        self.gate = GateLinear(config.hidden_size, num_experts, prefix=f"{prefix}.gate")
        bias = None
        if topk_method == "noaux_tc":
            # Steers the expert choice only (the weights stay the unbiased scores).
            bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                requires_grad=False)
            set_weight_attrs(bias, {"weight_loader": default_weight_loader})
        self.gate.e_score_correction_bias = bias
        self.shared_experts = None
        if config.n_shared_experts:
            # reduce_results=False: routed and shared partial sums are reduced once, together.
            self.shared_experts = LlamaMLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                config.hidden_act, quant_config=quant_config, reduce_results=False,
                prefix=f"{prefix}.shared_experts")
        n_group = getattr(config, "n_group", None) or 1
        self.experts = FusedMoE(
            num_experts=num_experts, top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
            reduce_results=False, renormalize=config.norm_topk_prob, quant_config=quant_config,
            use_grouped_topk=topk_method != "greedy", num_expert_group=n_group,
            topk_group=getattr(config, "topk_group", None) or 1, scoring_func=scoring_func,
            routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0),
            e_score_correction_bias=bias,
            expert_mapping=FusedMoE.make_expert_params_mapping(None, "w1", "w2", "w3",
                                                               num_experts),
            prefix=f"{prefix}.experts")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits, _ = self.gate(hidden_states)                  # [T, E]
        out = self.experts(hidden_states=hidden_states, router_logits=router_logits)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return self.experts.maybe_all_reduce_tensor_model_parallel(out)


class DeepseekV2DecoderLayer(MoeDecoderLayer):
    """Llama's pre-norm block with MLA, and DeepSeek's MoE from `first_k_dense_replace` on."""

    attn_cls = DeepseekV2MLAAttention

    def sparse(self, config: Any, layer_idx: int) -> bool:
        if layer_types := getattr(config, "mlp_layer_types", None):    # GLM-4.7-Flash
            return layer_types[layer_idx] == "sparse"
        freq = getattr(config, "moe_layer_freq", 1) or 1
        return (config.n_routed_experts is not None
                and layer_idx >= config.first_k_dense_replace and layer_idx % freq == 0)

    def make_moe(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        return DeepseekV2MoE(config, quant_config, prefix)


class DeepseekV2Model(LlamaModel):
    hf_to_vllm_mapper = EXPERT_NAMES_MAPPER | _MLP_STACKING

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = DeepseekV2DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        config = vllm_config.model_config.hf_config
        mapper = type(self).hf_to_vllm_mapper
        if config.q_lora_rank is not None:
            mapper = mapper | _FUSED_QKV_A
        if getattr(config, "num_nextn_predict_layers", 0):
            # V3 checkpoints carry their multi-token-prediction layers after the last decoder
            # layer; they belong to a draft model, not to this one.
            first, last = config.num_hidden_layers, (config.num_hidden_layers
                                                     + config.num_nextn_predict_layers)
            names = "|".join(str(i) for i in range(first, last))
            mapper = mapper | WeightsMapper(orig_to_new_regex={
                rf"^model\.layers\.({names})\.": None})
        self.hf_to_vllm_mapper = mapper


class DeepseekV2ForCausalLM(MoeForCausalLM):
    """DeepSeek-V2 with an LM head; PP, LoRA and quantization as Llama."""

    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"],
                              "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}
    hf_to_vllm_mapper = DeepseekV2Model.hf_to_vllm_mapper
    model_cls = DeepseekV2Model
    layer_cls = DeepseekV2DecoderLayer


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1, Kimi-K2, Moonlight: V2's layers with sigmoid routing (the
    differences are all config fields)."""


class Glm4MoeLiteForCausalLM(DeepseekV2ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's layers (MLA, sigmoid routing with the correction bias),
    dense or sparse MLP per `mlp_layer_types`."""


__all__ = ["DeepseekV2DecoderLayer", "DeepseekV2ForCausalLM", "DeepseekV2MLAAttention",
           "DeepseekV2MoE", "DeepseekV2Model", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM",
           "mla_softmax_scale"]
