"""PunicaWrapper: the step's token -> adapter-slot mapping that every LoRA layer reads.

vLLM names its batched-LoRA helper after Punica (multi-tenant LoRA serving); here it is the
per-step metadata plus the one vectorised computation all LoRA linears share:

    delta[t] = B[slot(t)] @ A[slot(t)] @ x[t]        (0 for base-model tokens, slot -1)

computed for all tokens at once as a masked product over the slot table:

    shrink = x @ A_all^T                [T, L * nR]   (A_all = A of every slot, stacked)
    shrink *= onehot(slot(t))           zeroes the columns of every other slot
    out[:, slice k] += shrink_k @ B_k   [T, L * R] @ [L * R, o_k] per packed slice k

With a single active slot the product uses only that slot's A and B. The runner sets the
mapping once per step (`update`), before the forward.
"""

from __future__ import annotations

import torch


class PunicaWrapper:
    """Holds the current step's mapping; `add_lora_linear` applies it to one layer."""

    def __init__(self, max_loras: int, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.dtype = dtype
        self.clear()

    def clear(self) -> None:
        """Every token uses the base model (warm-up, steps without adapters)."""
        self.active_slots: list[int] = []
        self.num_tokens = 0
        self.slot_mask: torch.Tensor | None = None     # [T, L] one-hot (multi-slot steps)
        self.single_mask: torch.Tensor | None = None   # [T, 1] (one slot, some base tokens)

    def update(self, token_slots: torch.Tensor) -> None:
        """`token_slots` [T] int64: each token's slot, -1 for the base model."""
        self.clear()
        self.num_tokens = int(token_slots.numel())
        self.active_slots = sorted(set(token_slots.tolist()) - {-1})
        if len(self.active_slots) == 1:
            slot = self.active_slots[0]
            if bool((token_slots != slot).any()):
                self.single_mask = (token_slots == slot).to(self.dtype)[:, None]
        elif self.active_slots:
            slots = torch.arange(self.max_loras)
            self.slot_mask = (token_slots[:, None] == slots[None, :]).to(self.dtype)

    def add_lora_linear(self, out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                        lora_b: list[torch.Tensor], out_slices: list[tuple[int, int]]) -> None:
        """`out[:, off:off+size] += delta` in place, for each packed slice.

        x [T, in]; out [T, out_local]; lora_a [L, n*R, in] (slice k's A rows at k*R);
        lora_b[k] [L, R, o_k] (B transposed, scaling folded in); out_slices[k] = (off, o_k).
        """
        if not self.active_slots:
            return
        if x.shape[0] != self.num_tokens:
            raise RuntimeError(f"LoRA mapping is for {self.num_tokens} tokens, the layer got "
                               f"{x.shape[0]}: set the mapping before each forward")
        num_slices = len(lora_b)
        rank = lora_b[0].shape[1]
        x = x.to(lora_a.dtype)
        if len(self.active_slots) == 1:
            slot = self.active_slots[0]
            shrink = x @ lora_a[slot].T                                    # [T, n*R]
            if self.single_mask is not None:
                shrink.mul_(self.single_mask)
            for k, (offset, size) in enumerate(out_slices):
                _add_product(out[:, offset:offset + size], shrink[:, k * rank:(k + 1) * rank],
                             lora_b[k][slot])
            return
        num_tokens, num_loras = x.shape[0], lora_a.shape[0]
        shrink = x @ lora_a.reshape(num_loras * num_slices * rank, -1).T  # [T, L*n*R]
        shrink = shrink.view(num_tokens, num_loras, num_slices, rank)
        shrink.mul_(self.slot_mask[:, :, None, None])
        for k, (offset, size) in enumerate(out_slices):
            _add_product(out[:, offset:offset + size],
                         shrink[:, :, k, :].reshape(num_tokens, num_loras * rank),
                         lora_b[k].reshape(num_loras * rank, size))


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b in place (out may be a column slice of a larger tensor)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out.add_((a @ b).to(out.dtype))
