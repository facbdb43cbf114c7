"""The MoE execution pipeline (vLLM 0.33's `fused_moe.runner` package)."""

from minivllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner, SharedExperts

__all__ = ["MoERunner", "SharedExperts"]
