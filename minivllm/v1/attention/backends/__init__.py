"""Attention backends: the pure-PyTorch paged backend for CPU."""

from minivllm.v1.attention.backends.cpu_attn import TorchAttentionBackend, TorchAttentionImpl
from minivllm.v1.attention.backends.cpu_attn_metadata import (CommonAttentionMetadata,
                                                              TorchAttentionMetadata,
                                                              TorchAttentionMetadataBuilder)

__all__ = ["CommonAttentionMetadata", "TorchAttentionBackend", "TorchAttentionImpl",
           "TorchAttentionMetadata", "TorchAttentionMetadataBuilder"]
