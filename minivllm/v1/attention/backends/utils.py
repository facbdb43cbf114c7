"""Attention-metadata types vLLM's model files test for (vLLM's `v1.attention.backends.utils`)."""

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVSharingFastPrefillMetadata(Protocol):
    """Metadata of vLLM's "fast prefill" for KV-sharing models (Gemma-3n / Gemma-4): only the
    tokens whose logits are needed run the layers that read another layer's KV. minivllm's
    metadata never is one (it runs every token through every layer), so files that check
    `isinstance(md, KVSharingFastPrefillMetadata)` take their plain path."""

    logits_indices_padded: torch.Tensor | None
    num_logits_indices: int | None
