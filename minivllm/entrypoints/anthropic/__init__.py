"""Anthropic's Messages API (vLLM's `vllm.entrypoints.anthropic`), served beside the OpenAI one:
`protocol.py` (bodies and their chat translation), `serving.py` (answers and events),
`api_router.py` (the routes)."""
