"""minivllm.v1.core: the scheduler's shared types."""
