"""minivllm.model_executor."""
