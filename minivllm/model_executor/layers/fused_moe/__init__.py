"""Mixture-of-experts layers (vLLM's path): `FusedMoE`, `SharedFusedMoE` and the MoE functions."""

from minivllm.model_executor.layers.fused_moe.fused_moe import (fused_experts, fused_moe,
                                                                fused_topk, grouped_topk)
from minivllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from minivllm.model_executor.layers.fused_moe.layer import FusedMoE, determine_expert_map
from minivllm.model_executor.layers.fused_moe.shared_fused_moe import SharedFusedMoE

__all__ = ["FusedMoE", "FusedMoEMethodBase", "SharedFusedMoE", "determine_expert_map",
           "fused_experts", "fused_moe", "fused_topk", "grouped_topk"]
