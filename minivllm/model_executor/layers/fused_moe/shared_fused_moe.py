"""`SharedFusedMoE` (vLLM's name for a FusedMoE with shared experts beside the routed ones)."""

from minivllm.model_executor.layers.fused_moe.layer import FusedMoE


class SharedFusedMoE(FusedMoE):
    """`FusedMoE(shared_experts=..., gate=...)`; `forward` returns `(shared_output, routed_output)`
    when shared experts are given, the routed output alone otherwise (both are FusedMoE's)."""

