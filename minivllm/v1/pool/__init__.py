"""Pooling-step metadata (vLLM's `v1/pool`)."""
