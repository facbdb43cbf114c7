"""minivllm.v1.attention."""
