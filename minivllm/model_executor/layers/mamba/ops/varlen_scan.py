"""The varlen frame both SSM scans run in: a step's sequences laid end to end ([T, ...] token
rows, `query_start_loc`), each with a state slot. Decode rows (one token) take one recurrent
step together; longer rows are padded into [r, L] (L a multiple of the chunk) and scanned
together; the final states go back to the slots. Nothing loops over tokens or sequences.

Padding is zeros; a scan must treat a zero dt as "no decay, no input" so that a padded row's
final state is its state after its last real token (both Mamba scans do).
"""

from collections.abc import Callable

import torch

from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata

# (token inputs of the rows [r, ...] each, init [r, ...]) -> (y [r, ...], final state [r, ...])
StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (padded inputs [r, L, ...] each, init [r, ...], chunk) -> (y [r, L, ...], final [r, ...])
ChunkScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def pad_rows(values: torch.Tensor, md: ShortConvAttentionMetadata, rows: torch.Tensor,
             length: int) -> torch.Tensor:
    """values [T, ...] -> [len(rows), length, ...]: batch rows `rows`, zero padded at the end."""
    starts = md.query_start_loc[rows]
    lens = md.query_start_loc[rows + 1] - starts
    offs = torch.arange(length, device=values.device)
    index = (starts[:, None] + offs).clamp(max=values.shape[0] - 1)     # [r, L]
    valid = offs < lens[:, None]
    out = values.index_select(0, index.reshape(-1)).view(len(rows), length, *values.shape[1:])
    return out * valid.view(len(rows), length, *([1] * (values.dim() - 1)))


def unpad_rows(md: ShortConvAttentionMetadata, rows: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The way back from `pad_rows`: (token index [n], mask [len(rows), length]) such that
    out[tok] = padded[mask] drops the padded positions."""
    offs = torch.arange(length, device=md.query_start_loc.device)
    starts = md.query_start_loc[rows]
    keep = offs < (md.query_start_loc[rows + 1] - starts)[:, None]      # [r, L]
    return (starts[:, None] + offs)[keep], keep


def scan_varlen(inputs: tuple[torch.Tensor, ...], y_shape: tuple[int, ...],
                state: torch.Tensor, md: ShortConvAttentionMetadata, write_state: bool,
                step: StepFn, chunk_scan: ChunkScanFn, chunk_size: int) -> torch.Tensor:
    """Runs a scan over every sequence of a step. inputs: [T, ...] token tensors (fp32);
    state [slots, ...] is read (sequences with an initial state) and, when write_state,
    overwritten. Returns y [T, *y_shape[1:]] fp32 (y_shape[0] == T)."""
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]          # [num_reqs]
    init = state.index_select(0, md.state_indices).float()
    init = init.masked_fill(~md.has_initial_state.view(-1, *([1] * (init.dim() - 1))), 0)
    y = inputs[0].new_zeros(y_shape)
    final = torch.empty_like(init)
    single = q_lens == 1
    dec = torch.nonzero(single).flatten()
    if dec.numel():
        tok = md.query_start_loc[dec]
        y[tok], final[dec] = step(*(t[tok] for t in inputs), init[dec])
    pre = torch.nonzero(~single & (q_lens > 0)).flatten()
    if pre.numel():
        longest = int(q_lens[pre].max())
        chunk = min(chunk_size, longest)
        length = -(-longest // chunk) * chunk
        padded = (pad_rows(t, md, pre, length) for t in inputs)
        y_pre, final[pre] = chunk_scan(*padded, init[pre], chunk)
        tok, keep = unpad_rows(md, pre, length)       # back to token rows, padding dropped
        y[tok] = y_pre[keep]
    if write_state:
        state.index_copy_(0, md.state_indices, final.to(state.dtype))
    return y
