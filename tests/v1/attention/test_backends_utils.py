"""KVSharingFastPrefillMetadata: a runtime-checkable protocol minivllm's metadata does not meet."""

from types import SimpleNamespace

import torch

from minivllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata


def test_protocol_recognises_fast_prefill_metadata_only() -> None:
    fast = SimpleNamespace(logits_indices_padded=torch.zeros(4, dtype=torch.long),
                           num_logits_indices=3)
    plain = SimpleNamespace(query_start_loc=torch.zeros(2, dtype=torch.long))
    assert isinstance(fast, KVSharingFastPrefillMetadata)
    assert not isinstance(plain, KVSharingFastPrefillMetadata)
