"""Gated DeltaNet linear-attention layers (vLLM's `layers.mamba.gdn` package)."""
