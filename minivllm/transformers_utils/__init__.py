"""minivllm.transformers_utils."""
