"""`AttentionLayerBase`: what attention-like layers (those with a KV cache) provide."""

from abc import ABC, abstractmethod
from typing import Any

import torch


class AttentionLayerBase(ABC):
    """A layer the runner gives a cache: it registers in the forward context and is bound its
    cache tensor (vLLM's base class; minivllm's `Attention` has the same methods)."""

    supports_dcp: bool = False
    is_draft_layer: bool = False

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    @abstractmethod
    def get_attn_backend(self) -> type:
        ...

    @abstractmethod
    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        ...
