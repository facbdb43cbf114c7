"""Token masks on logits rows (the structured-output grammar bitmask, allowed_token_ids,
bad_words, min_tokens) and the per-step index tensors they and logit_bias read."""

from __future__ import annotations

import sys

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                          rows: torch.Tensor) -> torch.Tensor:
    """-inf, in place, on the tokens the grammars forbid: bitmask [C, W] int32 (bit t of word w
    allows token 32 * w + t) over logits rows `rows` [C] of logits [B, V], all rows in one op.

    The mask becomes an additive bias of 0 / -inf in the logits' dtype (exact in bf16 too, so
    greedy rows can take the bf16 argmax), added with one index_add_.
    NOTE: no masked_fill / where and no fresh [B, V] float tensor: on CPU, masked_fill over a
    [64, 49152] batch took ~40 ms and each new [B, V] fp32 tensor ~15 ms of page faults, against
    ~5 ms for this whole function.
    """
    bias = _grammar_bias(bitmask, logits.shape[1], logits.dtype).to(logits.device)   # [C, V]
    return logits.index_add_(0, rows.to(logits.device), bias)


def _grammar_bias(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[C, V] of 0 where allowed and -inf where not, in `dtype`."""
    int_dtype = _SAME_SIZE_INT[torch.empty((), dtype=dtype).element_size()]
    neg_inf_bits = torch.tensor(float("-inf"), dtype=dtype).view(int_dtype).item()
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        # Little-endian int32 words: their bytes' bits, low bit first, are the tokens in order.
        bits = torch.from_numpy(np.unpackbits(bitmask.contiguous().numpy().view(np.uint8),
                                              axis=1, bitorder="little"))   # [C, 32 W] uint8
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)  # [C, 32 W]
    if bits.shape[1] < vocab_size:   # ids past the mask: not the grammar's tokens
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]))
    # 1 -> 0 -> 0.0 and 0 -> -1 (all bits set) -> the bits of -inf, then reinterpreted.
    bias = bits[:, :vocab_size].to(int_dtype).sub_(1).bitwise_and_(neg_inf_bits)
    return bias.view(dtype)


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def mask_rows(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """-inf where `allowed` [R, <=V] bool is False in logits rows `rows` [R] (and past its
    width), one gather and one scatter for all rows."""
    width = allowed.shape[1]
    selected = logits.index_select(0, rows)                                  # [R, V]
    selected[:, :width] = selected[:, :width].masked_fill(~allowed, float("-inf"))
    selected[:, width:] = float("-inf")   # ids past the mask: not the grammar's tokens
    return logits.index_copy(0, rows, selected)


def ban_tokens(logits: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """-inf at the (rows [N], token_ids [N]) pairs of `index` in logits [B, V], in one op."""
    return logits.index_put(index, torch.tensor(float("-inf"), dtype=logits.dtype,
                                                device=logits.device))


def allowed_token_mask(params: list[SamplingParams], vocab_size: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows [R], allowed [R, V] bool) of the rows with allowed_token_ids, or None."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None
    allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    index = [(r, t) for r, i in enumerate(rows) for t in params[i].allowed_token_ids]
    allowed[tuple(torch.tensor(index, device=device).T)] = True
    return torch.tensor(rows, device=device), allowed


def min_tokens_mask_index(rows: list[tuple[SamplingParams, int]], vocab_size: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token_ids) of the eos / stop ids to ban in rows still short of min_tokens;
    `rows[i]` is row i's (params, number of output tokens)."""
    pairs = [(i, t) for i, (p, num_output_tokens) in enumerate(rows)
             if num_output_tokens < p.min_tokens for t in p.all_stop_token_ids if t < vocab_size]
    if not pairs:
        return None
    index = torch.tensor(pairs, device=device)   # [N, 2] (row, token)
    return index[:, 0], index[:, 1]


def logit_bias_index(params: list[SamplingParams], device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, token_ids, biases) of every logit_bias entry of the batch, or None."""
    entries = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if not entries:
        return None
    rows, token_ids, biases = zip(*entries)
    return (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


def bad_words_mask_index(rows: list[tuple[list[list[int]], list[int] | None]], vocab_size: int,
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows [N], token_ids [N]) to ban this step; `rows[i]` is row i's (bad_words_token_ids,
    recent output tokens). None when nothing is banned."""
    pairs = [(i, t) for i, (words, recent) in enumerate(rows) if words
             for t in bad_words_bans(words, recent, vocab_size)]
    if not pairs:
        return None
    index = torch.tensor(pairs, device=device)   # [N, 2] (row, token)
    return index[:, 0], index[:, 1]


def bad_words_bans(bad_words_token_ids: list[list[int]], recent_tokens: list[int] | None,
                   vocab_size: int) -> list[int]:
    """The tokens one row must not sample now: each one-token bad word, and the last token of
    each longer one whose other tokens end the output so far (vLLM's rule: the prompt does not
    count). `recent_tokens` holds at least the last `bad_words_context` output tokens."""
    banned = []
    for ids in bad_words_token_ids:
        if ids[-1] >= vocab_size:
            continue
        prefix_len = len(ids) - 1
        if prefix_len == 0 or (recent_tokens is not None and len(recent_tokens) >= prefix_len
                               and recent_tokens[len(recent_tokens) - prefix_len:] == ids[:-1]):
            banned.append(ids[-1])
    return banned


def bad_words_context(params: SamplingParams) -> int:
    """How many of the last output tokens the bad_words rule reads."""
    return max(len(ids) for ids in params.bad_words_token_ids) - 1
