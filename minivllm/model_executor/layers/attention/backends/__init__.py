"""The CPU attention backend: paged KV write, native decode and prompt kernels, gather + SDPA."""

from minivllm.model_executor.layers.attention.backends.cpu_attn import (TorchAttentionBackend,
                                                                     TorchAttentionImpl)
from minivllm.model_executor.layers.attention.backends.cpu_attn_metadata import (
    CommonAttentionMetadata, TorchAttentionMetadata, TorchAttentionMetadataBuilder)

__all__ = ["CommonAttentionMetadata", "TorchAttentionBackend", "TorchAttentionImpl",
           "TorchAttentionMetadata", "TorchAttentionMetadataBuilder"]
