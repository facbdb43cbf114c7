"""Mixture-of-experts layers (vLLM's path): vLLM 0.33's `FusedMoEFactory` (-> `MoERunner` with
`RoutedExperts`, `FusedMoERouter`, `GateLinear`), the older `FusedMoE` / `SharedFusedMoE`, and
the MoE functions."""

from minivllm.model_executor.layers.fused_moe.activation import activation_without_mul
from minivllm.model_executor.layers.fused_moe.fused_moe import (fused_experts, fused_moe,
                                                                fused_topk, grouped_topk)
from minivllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from minivllm.model_executor.layers.fused_moe.layer import (FusedMoE, FusedMoEFactory,
                                                            fused_moe_make_expert_params_mapping)
from minivllm.model_executor.layers.fused_moe.routed_experts import (RoutedExperts,
                                                                     determine_expert_map)
from minivllm.model_executor.layers.fused_moe.router import FusedMoERouter, GateLinear
from minivllm.model_executor.layers.fused_moe.runner import MoERunner, SharedExperts
from minivllm.model_executor.layers.fused_moe.shared_fused_moe import SharedFusedMoE

__all__ = ["FusedMoE", "FusedMoEFactory", "FusedMoEMethodBase", "FusedMoERouter", "GateLinear",
           "MoERunner", "RoutedExperts", "SharedExperts", "SharedFusedMoE",
           "activation_without_mul", "determine_expert_map", "fused_experts", "fused_moe",
           "fused_moe_make_expert_params_mapping", "fused_topk", "grouped_topk"]
