"""Shared constants of the quantization formats (vLLM's `quantization.utils` package)."""
