"""MoE routing (vLLM 0.33's `fused_moe.router` package): the router and the gate projection."""

from minivllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter
from minivllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

__all__ = ["FusedMoERouter", "GateLinear"]
