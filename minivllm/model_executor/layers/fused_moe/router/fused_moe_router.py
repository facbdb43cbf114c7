"""`FusedMoERouter`: router logits -> (topk_weights, topk_ids), the one home of MoE routing.

Scoring (softmax or sigmoid), optional renormalisation, an optional score-correction bias that
only steers the choice, DeepSeek-style grouped top-k, a model's own routing function, and the
routed scaling factor (applied to the weights). bf16 logits take the native top-k kernel where
it covers the case (`cpu_fused_moe.moe_topk`).
"""

from collections.abc import Callable

import torch

from minivllm.model_executor.layers.fused_moe.cpu_fused_moe import moe_topk
from minivllm.model_executor.layers.fused_moe.fused_moe import (SCORING_FUNCS, fused_topk,
                                                                grouped_topk)


class FusedMoERouter:
    """Routing settings of one MoE layer; `select_experts` applies them."""

    def __init__(self, top_k: int, global_num_experts: int, renormalize: bool = True,
                 use_grouped_topk: bool = False, num_expert_group: int | None = None,
                 topk_group: int | None = None, custom_routing_function: Callable | None = None,
                 scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: torch.Tensor | None = None) -> None:
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"Unsupported scoring function {scoring_func!r}; choose one of "
                             f"{', '.join(SCORING_FUNCS)}")
        self.top_k, self.global_num_experts = top_k, global_num_experts
        self.renormalize, self.use_grouped_topk = renormalize, use_grouped_topk
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.custom_routing_function, self.scoring_func = custom_routing_function, scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        self.e_score_correction_bias = e_score_correction_bias

    def select_experts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                       **_unused: object) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32, topk_ids [T, k] global ids), routed_scaling_factor applied."""
        if self.use_grouped_topk:
            return grouped_topk(
                hidden_states, router_logits, self.top_k, self.renormalize,
                # No group count (DeepSeek-V2-Lite's n_group null): all experts in one group.
                self.num_expert_group or 1, self.topk_group or 1, self.scoring_func,
                self.routed_scaling_factor, self.e_score_correction_bias)
        # bf16 only: fp32 models keep torch's routing bit for bit (their experts stay in torch).
        # Compiled graphs take torch's routing (a ctypes call would break the graph).
        if (self.custom_routing_function is None and self.e_score_correction_bias is None
                and not torch.compiler.is_compiling()
                and router_logits.dtype == torch.bfloat16):
            native = moe_topk(router_logits, self.top_k, self.renormalize, self.scoring_func,
                              self.routed_scaling_factor)
            if native is not None:                      # routing in C (a CPU graph records it)
                return native
        if self.custom_routing_function is not None:
            weights, ids = self.custom_routing_function(hidden_states, router_logits,
                                                        self.top_k, self.renormalize)
            weights, ids = weights.float(), ids.long()
        else:
            weights, ids, _ = fused_topk(
                hidden_states, router_logits, self.top_k, self.renormalize,
                scoring_func=self.scoring_func,
                e_score_correction_bias=self.e_score_correction_bias)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights, ids
