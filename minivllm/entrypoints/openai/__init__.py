"""The OpenAI-compatible server: `minivllm serve` (FastAPI + uvicorn around AsyncLLM; the app is
`api_server.build_app`). Nothing is imported here, so that `minivllm.entrypoints.openai.cli`
(imported by every `minivllm` command) does not pull FastAPI and the engine in."""
