"""minivllm.compilation."""
