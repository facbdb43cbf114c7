"""vLLM's `vllm.utils` package: small torch and integer helpers (`torch_utils`, `math_utils`)."""

__all__: list[str] = []
