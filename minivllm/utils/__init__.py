"""vLLM's `vllm.utils` package: small torch, integer and text helpers (`torch_utils`, `math_utils`,
`unicode_utils`)."""

__all__: list[str] = []
