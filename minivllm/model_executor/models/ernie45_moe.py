"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's attention (interleaved RoPE,
`use_bias`) with sparse blocks on the layers the config picks.

A sparse block routes with an fp32 softmax gate; the top-k choice is steered by a learned
per-expert bias (`moe_statics.e_score_correction_bias`) while the weights stay the unbiased
probabilities, renormalised over the chosen k. Shared experts (one MLP of
`moe_num_shared_experts * moe_intermediate_size`) add to every token, ungated. Layers outside
`[moe_layer_start_index, moe_layer_end_index]`, or off the `moe_layer_interval` grid, keep a
dense MLP. The checkpoint's multi-token-prediction weights (`model.mtp_*`) are skipped.
"""

from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.fused_moe import FusedMoE
from minivllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.parameter import set_weight_attrs

from .ernie45 import Ernie4_5Attention, ernie_mlp
from .interfaces import MixtureOfExperts
from .llama import LlamaModel
from .qwen2_moe import EXPERT_NAMES_MAPPER, MoeDecoderLayer, MoeForCausalLM
from .utils import PPMissingLayer, WeightsMapper


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """ERNIE's rule: every `moe_layer_interval`-th layer inside [start, end] (end -1: the last)."""
    start = getattr(config, "moe_layer_start_index", 0)
    end = getattr(config, "moe_layer_end_index", -1)
    end = config.num_hidden_layers - 1 if end is None or end < 0 else end
    interval = getattr(config, "moe_layer_interval", 1) or 1
    return start <= layer_idx <= end and (layer_idx + 1) % interval == 0


def _load_correction_bias(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    # The checkpoint stores [1, E] (one expert group); the router adds a [E] row.
    assert loaded_weight.numel() == param.numel(), (
        f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})")
    param.data.copy_(loaded_weight.reshape(param.shape))


class Ernie4_5_MoeStatics(nn.Module):
    """Holds the routing bias under the checkpoint's name: `e_score_correction_bias` [E], fp32."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(self.e_score_correction_bias, {"weight_loader": _load_correction_bias})


class Ernie4_5_MoeMoE(nn.Module):
    """fp32 gate -> bias-steered top-k -> FusedMoE experts, plus the ungated shared experts;
    hidden [T, H] -> [T, H], all-reduced once."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        num_experts = config.moe_num_experts
        # fp32 weights and logits, as the reference router (it runs outside autocast).
        self.gate = GateLinear(config.hidden_size, num_experts, params_dtype=torch.float32,
                               out_dtype=torch.float32, prefix=f"{prefix}.gate")
        self.moe_statics = Ernie4_5_MoeStatics(num_experts)
        self.shared_experts = None
        if getattr(config, "moe_num_shared_experts", 0):
            # reduce_results=False: routed and shared partial sums are reduced once, together.
            self.shared_experts = ernie_mlp(
                config, config.moe_intermediate_size * config.moe_num_shared_experts,
                quant_config, f"{prefix}.shared_experts", reduce_results=False)
        self.experts = FusedMoE(
            num_experts=num_experts, top_k=config.moe_k, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size, reduce_results=False,
            renormalize=True, quant_config=quant_config,
            e_score_correction_bias=self.moe_statics.e_score_correction_bias,
            expert_mapping=FusedMoE.make_expert_params_mapping(None, "w1", "w2", "w3",
                                                               num_experts),
            prefix=f"{prefix}.experts")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits, _ = self.gate(hidden_states)                  # [T, E] fp32
        out = self.experts(hidden_states=hidden_states, router_logits=router_logits)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)           # partial [T, H]
        return self.experts.maybe_all_reduce_tensor_model_parallel(out)


class Ernie4_5_MoeDecoderLayer(MoeDecoderLayer):
    """ERNIE attention + ERNIE's sparse block on MoE layers, its (biased) dense MLP elsewhere."""

    attn_cls = Ernie4_5Attention

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config: Any = None,
                 attn_layer_type: type[nn.Module] | None = None) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)
        config = config or vllm_config.model_config.hf_config
        if getattr(config, "use_bias", False) and not isinstance(self.mlp, Ernie4_5_MoeMoE):
            self.mlp = ernie_mlp(config, config.intermediate_size,
                                 self.get_quant_config(vllm_config), f"{prefix}.mlp")

    def sparse(self, config: Any, layer_idx: int) -> bool:
        return is_moe_layer(config, layer_idx)

    def make_moe(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        return Ernie4_5_MoeMoE(config, quant_config, prefix)


class Ernie4_5_MoeModel(LlamaModel):
    # The MTP block is dropped under its full name and under the one this model's loader sees
    # ("model." stripped by the causal-LM wrapper's loader).
    hf_to_vllm_mapper = (EXPERT_NAMES_MAPPER | LlamaModel.hf_to_vllm_mapper
                         | WeightsMapper(orig_to_new_prefix={"model.mtp_": None, "mtp_": None}))

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Ernie4_5_MoeDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Ernie4_5_MoeForCausalLM(MoeForCausalLM, MixtureOfExperts):
    """ERNIE 4.5 MoE with an LM head; LoRA and PP as Llama; expert counts for the
    MixtureOfExperts interface (no EPLB: physical experts are the logical ones)."""

    model_cls = Ernie4_5_MoeModel
    layer_cls = Ernie4_5_MoeDecoderLayer
    hf_to_vllm_mapper = Ernie4_5_MoeModel.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.moe_layers = [layer.mlp.experts for layer in self.model.layers
                           if not isinstance(layer, PPMissingLayer)
                           and isinstance(layer.mlp, Ernie4_5_MoeMoE)]
        self.expert_weights = []
        self.num_moe_layers = len(self.moe_layers)
        num_experts = self.config.moe_num_experts
        self.num_logical_experts = self.num_physical_experts = num_experts
        self.num_local_physical_experts = self.num_routed_experts = num_experts
        self.num_shared_experts = getattr(self.config, "moe_num_shared_experts", 0) or 0
        self.num_expert_groups, self.num_redundant_experts = 1, 0


__all__ = ["Ernie4_5_MoeDecoderLayer", "Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeMoE",
           "Ernie4_5_MoeModel", "Ernie4_5_MoeStatics", "is_moe_layer"]
