"""minivllm: vLLM's model-file contract and engine, in readable PyTorch."""

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "ModelRegistry", "RequestOutput", "CompletionOutput",
           "EngineArgs", "AsyncEngineArgs", "AsyncLLMEngine", "PromptType", "TextPrompt",
           "TokensPrompt"]

__version__ = "0.1.0"

# Lazy attributes keep `import minivllm` cheap and free of import cycles.
_LAZY = {
    "LLM": ("minivllm.entrypoints.llm", "LLM"),
    "SamplingParams": ("minivllm.sampling_params", "SamplingParams"),
    "ModelRegistry": ("minivllm.model_executor.models.registry", "ModelRegistry"),
    "RequestOutput": ("minivllm.outputs", "RequestOutput"),
    "CompletionOutput": ("minivllm.outputs", "CompletionOutput"),
    "EngineArgs": ("minivllm.engine.arg_utils", "EngineArgs"),
    "AsyncEngineArgs": ("minivllm.engine.arg_utils", "AsyncEngineArgs"),
    # vLLM's top-level name for its asyncio engine (AsyncLLM in v1)
    "AsyncLLMEngine": ("minivllm.engine.async_llm", "AsyncLLM"),
    "PromptType": ("minivllm.inputs", "PromptType"),
    "TextPrompt": ("minivllm.inputs", "TextPrompt"),
    "TokensPrompt": ("minivllm.inputs", "TokensPrompt"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)


if TYPE_CHECKING:
    from minivllm.entrypoints.llm import LLM
    from minivllm.inputs import PromptType, TextPrompt, TokensPrompt
    from minivllm.sampling_params import SamplingParams
