"""vLLM's `v1.attention.backends` path; minivllm's backends live in
`model_executor/layers/attention/backends/`."""
