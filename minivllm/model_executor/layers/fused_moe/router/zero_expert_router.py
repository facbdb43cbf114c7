"""`ZeroExpertRouter` (vLLM 0.33): routing over real experts and "zero" experts that hold no
weights (LongCat-Flash's).

The router logits cover E real experts then Z zero experts [T, E + Z]; the top-k runs over all of
them (with the correction bias, also [E + Z]). A zero expert of type "identity" returns its input:
its weighted sum over the chosen zero experts, hidden [T, H] * sum_j w[t, j], is kept aside, and
the zero experts' slots become expert 0 with weight 0 so the routed experts skip them. The runner
adds the kept output once, after the routed sum is reduced.
"""

import torch

from minivllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter

ZERO_EXPERT_TYPES = ("identity",)


class ZeroExpertRouter(FusedMoERouter):
    """`select_experts` as FusedMoERouter's over E + Z experts; the zero experts' output waits
    in `zero_expert_output` (read once) for the runner."""

    def __init__(self, top_k: int, global_num_experts: int,
                 e_score_correction_bias: torch.Tensor | None, num_logical_experts: int,
                 zero_expert_type: str, scoring_func: str = "softmax", renormalize: bool = False,
                 routed_scaling_factor: float = 1.0) -> None:
        if zero_expert_type not in ZERO_EXPERT_TYPES:
            raise ValueError(f"Unsupported zero_expert_type {zero_expert_type!r}; choose one of "
                             f"{', '.join(ZERO_EXPERT_TYPES)}")
        super().__init__(top_k, global_num_experts, renormalize, scoring_func=scoring_func,
                         routed_scaling_factor=routed_scaling_factor,
                         e_score_correction_bias=e_score_correction_bias)
        self.num_logical_experts = num_logical_experts      # E: ids >= E are zero experts
        self.zero_expert_type = zero_expert_type
        self._zero_expert_output: torch.Tensor | None = None

    def select_experts(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                       **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().select_experts(hidden_states, router_logits, **kwargs)
        is_zero = ids >= self.num_logical_experts                        # [T, k]
        zero_weight = (weights * is_zero).sum(dim=-1, keepdim=True)      # [T, 1]
        self._zero_expert_output = (hidden_states.float() * zero_weight).to(hidden_states.dtype)
        return weights.masked_fill(is_zero, 0.0), ids.masked_fill(is_zero, 0)

    @property
    def zero_expert_output(self) -> torch.Tensor | None:
        """The last `select_experts`' zero-expert output [T, H], cleared as it is read."""
        output, self._zero_expert_output = self._zero_expert_output, None
        return output
