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


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     conv_states: torch.Tensor, query_start_loc: torch.Tensor,
                     cache_indices: torch.Tensor, has_initial_state: torch.Tensor,
                     activation: str | None = "silu", **kwargs: object) -> torch.Tensor:
    """vLLM's prefill form: x [dim, T] (channel-major) of the sequences query_start_loc
    delimits, weight [dim, K], conv_states [slots, dim, K - 1] (vLLM's view of the states;
    minivllm's rows are sequence-major underneath) read where has_initial_state and
    overwritten. Returns [dim, T] in x's dtype."""
    md = ShortConvAttentionMetadata(query_start_loc.long(), cache_indices.long(),
                                    has_initial_state.bool(), x.shape[1])
    out = causal_conv1d_varlen(x.transpose(0, 1), weight, bias, conv_states.transpose(-1, -2), md)
    return _activate(out, activation).to(x.dtype).transpose(0, 1)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         conv_state_indices: torch.Tensor | None = None,
                         num_accepted_tokens: torch.Tensor | None = None,
                         **kwargs: object) -> torch.Tensor:
    """vLLM's decode form: x [B, dim], one token per sequence on top of its saved state
    conv_state[conv_state_indices[i]] ([slots, dim, K - 1] view), which is advanced. Returns
    [B, dim] in x's dtype."""
    if num_accepted_tokens is not None or x.dim() != 2:
        raise NotImplementedError("causal_conv1d_update takes one token per sequence [B, dim] "
                                  "in minivllm (no speculative decoding)")
    num_seqs = x.shape[0]
    slots = (torch.arange(num_seqs) if conv_state_indices is None
             else conv_state_indices.long())
    md = ShortConvAttentionMetadata(torch.arange(num_seqs + 1), slots,
                                    torch.ones(num_seqs, dtype=torch.bool), num_seqs)
    out = causal_conv1d_varlen(x, weight, bias, conv_state.transpose(-1, -2), md)
    return _activate(out, activation).to(x.dtype)


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return torch.nn.functional.silu(out)
    if activation is None:
        return out
    raise ValueError(f"causal conv activation must be silu, swish or None, got {activation!r}")
