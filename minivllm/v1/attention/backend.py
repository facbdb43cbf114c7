"""Attention types shared by layers and backends."""

import enum
from abc import ABC, abstractmethod


class AttentionType(str, enum.Enum):
    """Which attention a layer performs; a `str` enum as in vLLM."""

    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER_DECODER = "encoder_decoder"


class AttentionBackend(ABC):
    """What a backend tells the layers and the runner: its name, the per-layer cache shape, the
    implementation and the per-step metadata builder (vLLM's abstract base)."""

    accept_output_buffer: bool = False
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        ...

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto",
                           head_size_v: int | None = None) -> tuple[int, ...]:
        ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type:
        ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type:
        ...


class AttentionMetadata:
    """vLLM's empty base of backends' per-step metadata: model files name it in annotations."""
