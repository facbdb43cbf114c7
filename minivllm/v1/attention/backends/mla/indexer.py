"""DeepSeek-V3.2's indexer backend: not supported on CPU (see `index_group.py`)."""

from minivllm.v1.attention.backend import AttentionBackend
from minivllm.v1.attention.backends.mla.index_group import _UNSUPPORTED


class DeepseekV32IndexerBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "DEEPSEEK_V32_INDEXER"

    @staticmethod
    def get_kv_cache_shape(*args: object, **kwargs: object) -> tuple[int, ...]:
        raise NotImplementedError(_UNSUPPORTED)

    @staticmethod
    def get_impl_cls() -> type:
        raise NotImplementedError(_UNSUPPORTED)

    @staticmethod
    def get_builder_cls() -> type:
        raise NotImplementedError(_UNSUPPORTED)
