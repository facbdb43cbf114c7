"""Causal depthwise convolution over a step's sequences, from and into their saved states.

A step may mix fresh prompts, prompt chunks and decodes. Every sequence's tokens are laid out
after its K - 1 state rows in one extended tensor, so the convolution is K shifted gathers over
the whole step (K is 3-4 in practice), never a loop over tokens or sequences.
"""

import torch

from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata


def single_sequence_metadata(num_tokens: int) -> ShortConvAttentionMetadata:
    """A dummy / profiling run's metadata: one sequence from a zero state."""
    return ShortConvAttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens]), state_indices=torch.zeros(
            1, dtype=torch.int64), has_initial_state=torch.zeros(1, dtype=torch.bool),
        num_actual_tokens=num_tokens)


def causal_conv1d_varlen(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, md: ShortConvAttentionMetadata | None
                         ) -> torch.Tensor:
    """out[t] = bias + sum_j weight[:, j] * u_ext[t - (K-1) + j], per sequence.

    u [T, C]; weight [C, K]; conv_state [slots, K - 1, C] is read for sequences with an initial
    state and overwritten with each sequence's last K - 1 inputs (not when md is None: a dummy
    run). Returns fp32 [T, C] (accumulated in fp32)."""
    kernel_size = weight.shape[1]
    s = kernel_size - 1
    num_tokens, channels = u.shape
    write_state = md is not None
    if md is None:
        md = single_sequence_metadata(num_tokens)
    num_reqs, qsl = md.num_reqs, md.query_start_loc
    seq = torch.arange(num_reqs, device=u.device)
    # ext [T + B*s, C]: each sequence's s state rows, then its tokens.
    tok_pos = torch.arange(num_tokens, device=u.device) + (md.token_rows + 1) * s          # [T]
    state_pos = (qsl[:-1] + seq * s)[:, None] + torch.arange(s, device=u.device)           # [B, s]
    state = conv_state.index_select(0, md.state_indices)                  # [B, s, C]
    state = state.masked_fill(~md.has_initial_state[:, None, None], 0)
    ext = u.new_empty(num_tokens + num_reqs * s, channels)
    ext[state_pos.reshape(-1)] = state.reshape(-1, channels).to(u.dtype)
    ext[tok_pos] = u
    weight = weight.float()
    out = torch.zeros(u.shape, dtype=torch.float32)
    for j in range(kernel_size):    # NOTE: K gathers of the whole step, not a token loop
        out.add_(ext.index_select(0, tok_pos - s + j).float() * weight[:, j])
    if bias is not None:
        out.add_(bias.float())
    if write_state:
        end = qsl[1:] + (seq + 1) * s                                     # [B]
        rows = (end - s)[:, None] + torch.arange(s, device=u.device)          # [B, s]
        last = ext.index_select(0, rows.reshape(-1))
        conv_state.index_copy_(0, md.state_indices,
                               last.view(num_reqs, s, channels).to(conv_state.dtype))
    return out
