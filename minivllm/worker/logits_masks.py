"""Token masks on logits rows: the structured-output grammar bitmask, allowed_token_ids and
bad_words."""

from __future__ import annotations

import torch

from minivllm.sampling_params import SamplingParams


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                          rows: torch.Tensor) -> torch.Tensor:
    """-inf on the tokens the grammars forbid: bitmask [C, W] int32 (bit t of word w allows
    token 32 * w + t) over logits rows `rows` [C] of logits [B, V], all rows in one op."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1       # [C, W, 32]
    allowed = allowed.view(bitmask.shape[0], -1)[:, :logits.shape[1]].bool()  # [C, V]
    return mask_rows(logits, rows, allowed)


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
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


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
