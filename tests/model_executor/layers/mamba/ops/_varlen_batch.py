"""A varlen step batch shared by the mamba ops tests: fresh prefills, continued chunks and
single-token decodes, each sequence in its own state slot."""

import torch

from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata

LENS = [7, 1, 130, 1, 3]
SLOTS = torch.tensor([3, 0, 1, 4, 2])
HAS_STATE = torch.tensor([False, True, True, False, True])


def step_metadata() -> ShortConvAttentionMetadata:
    qsl = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
    return ShortConvAttentionMetadata(qsl, SLOTS, HAS_STATE, sum(LENS))
