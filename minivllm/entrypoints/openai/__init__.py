"""The OpenAI-compatible server: `minivllm serve` (FastAPI + uvicorn around AsyncLLM)."""

__all__ = ["AsyncLLM", "build_app", "run_server"]


def __getattr__(name: str):
    # Lazy, so that `minivllm.entrypoints.openai.cli` (imported by every `minivllm` command)
    # does not pull FastAPI and the engine in.
    if name == "AsyncLLM":
        from minivllm.engine.async_llm import AsyncLLM
        return AsyncLLM
    if name in ("build_app", "run_server"):
        from minivllm.entrypoints.openai import api_server
        return getattr(api_server, name)
    raise AttributeError(f"module 'minivllm.entrypoints.openai' has no attribute {name!r}")
