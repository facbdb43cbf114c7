"""MiniMax's RMSNorm over all heads of a tensor-parallel q / k (vLLM's path)."""

from minivllm.model_executor.layers.minimax_rms_norm.rms_norm_tp import MiniMaxText01RMSNormTP

__all__ = ["MiniMaxText01RMSNormTP"]
