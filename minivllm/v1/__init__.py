"""minivllm.v1."""
