"""Layers with a per-sequence recurrent state instead of a KV cache (vLLM's `layers.mamba`)."""

from minivllm.model_executor.layers.mamba.short_conv import ShortConv

__all__ = ["ShortConv"]
