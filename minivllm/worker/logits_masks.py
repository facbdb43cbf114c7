"""Token masks on logits rows: the structured-output grammar bitmask and allowed_token_ids."""

from __future__ import annotations

import torch


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
