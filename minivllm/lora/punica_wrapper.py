"""PunicaWrapper: the step's token -> adapter-slot mapping that every LoRA layer reads.

vLLM names its batched-LoRA helper after Punica (multi-tenant LoRA serving); here it is the
per-step metadata plus the one vectorised computation all LoRA linears share:

    delta[t] = B[slot(t)] @ A[slot(t)] @ x[t]        (0 for base-model tokens, slot -1)

computed for all tokens at once, grouped by slot (the grouping is worked out once per step):

    xs = x[gather]                      [S, Tmax, in]   the tokens of each of the S active
                                                        slots, padded to the longest group
    ys = (xs @ A[s]^T) @ B[s]           two batched matmuls over the S slots
    out.index_add_(0, gather, ys)       padded rows are zero and add nothing

so each token meets only its own adapter's weights, in four or five torch calls per layer
whatever the batch holds. With a single active slot the products use that slot's A and B
directly. bf16 steps of up to NATIVE_MAX_TOKENS tokens on CPU take one native call instead
(`csrc/lora_shrink_expand.cpp`): at decode sizes each small bf16 bmm costs more than the base
layer. That call runs whatever the mapping holds (no adapter: every slot -1) and reads the
slot map from one fixed buffer, so CPU graphs capture and replay LoRA decode steps; the torch
path refuses a capture (its calls follow the mapping). The runner sets the mapping once per
step.
"""

from __future__ import annotations

import torch

from minivllm import _custom_ops as ops
from minivllm.compilation.cpu_graph import refuse_capture

# Steps of up to this many tokens take the native call; larger ones are GEMM-sized, where
# torch's batched matmuls (oneDNN / AMX) outrun the kernel's per-token dot products.
NATIVE_MAX_TOKENS = 64


class PunicaWrapper:
    """Holds the current step's mapping; `add_lora_linear` applies it to one layer."""

    def __init__(self, max_loras: int, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.dtype = dtype
        # The native path's slot map [<= NATIVE_MAX_TOKENS]: one buffer, so the address a CPU
        # graph recorded holds each later step's map.
        self._slot_buffer = torch.full((NATIVE_MAX_TOKENS,), -1, dtype=torch.int64)
        self.clear()

    def clear(self) -> None:
        """Every token uses the base model (warm-up, steps without adapters)."""
        self.active_slots: list[int] = []
        self.token_slots: torch.Tensor | None = None    # [T] int64
        self.num_tokens = 0
        self.single_mask: torch.Tensor | None = None   # [T, 1] (one slot, some base tokens)
        # Multi-slot steps: token index of each [slot group, row] (padding repeats a token),
        # the zero-one mask of real rows (None when no group is padded), the groups' slots.
        self.gather_index: torch.Tensor | None = None  # [S * Tmax] int64
        self.gather_mask: torch.Tensor | None = None   # [S * Tmax, 1]
        self.slot_index: torch.Tensor | None = None    # [S] int64 (None: all slots, in order)
        self.max_group = 0
        # When each slot's tokens are one contiguous run (the runner sorts requests by
        # adapter): (slot, first token, end) per active slot, for row-range products.
        self.runs: list[tuple[int, int, int]] | None = None

    def update(self, token_slots: torch.Tensor) -> None:
        """`token_slots` [T] int64: each token's slot, -1 for the base model."""
        self.clear()
        self.num_tokens = int(token_slots.numel())
        if self.num_tokens <= NATIVE_MAX_TOKENS:
            self.token_slots = self._slot_buffer[:self.num_tokens]
            self.token_slots.copy_(token_slots)
        else:
            self.token_slots = token_slots.to(torch.int64).contiguous()
        self.active_slots = sorted(set(token_slots.tolist()) - {-1})
        if len(self.active_slots) == 1:
            slot = self.active_slots[0]
            if bool((token_slots != slot).any()):
                self.single_mask = (token_slots == slot).to(self.dtype)[:, None]
        elif self.active_slots:
            self._group_by_slot(token_slots)
        if len(self.active_slots) > 1:
            self.runs = _contiguous_runs(token_slots, len(self.active_slots))

    def _group_by_slot(self, token_slots: torch.Tensor) -> None:
        active = torch.tensor(self.active_slots)
        counts = (token_slots[None, :] == active[:, None]).sum(1)              # [S]
        self.max_group = int(counts.max())
        order = torch.argsort(token_slots, stable=True)                          # base (-1) first
        order = order[len(order) - int(counts.sum()):]                          # lora tokens, by slot
        starts = torch.cumsum(counts, 0) - counts                                # [S]
        row = torch.arange(self.max_group)
        # position in `order` of group s, row j (clamped into the group: padding repeats a token)
        pos = starts[:, None] + torch.minimum(row[None, :], counts[:, None] - 1)
        self.gather_index = order[pos].reshape(-1)
        if bool((counts < self.max_group).any()):
            self.gather_mask = (row[None, :] < counts[:, None]).reshape(-1, 1).to(self.dtype)
        if self.active_slots != list(range(self.max_loras)):
            self.slot_index = active

    def add_lora_linear(self, out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                        lora_b: torch.Tensor, slices: torch.Tensor | None = None) -> None:
        """`out += delta` in place. x [T, in]; out [T, out]; lora_a [L, nR, in];
        lora_b [L, nR, out] (B transposed, block-diagonal over packed slices, scaled);
        slices: int64 [n, 2] (output offset, size) of each packed slice, for the native call."""
        if x.shape[0] != self.num_tokens:
            if not self.active_slots:         # no mapping (a warm-up run): the base model
                refuse_capture("a LoRA layer ran without the step's adapter mapping")
                return
            raise RuntimeError(f"LoRA mapping is for {self.num_tokens} tokens, the layer got "
                               f"{x.shape[0]}: set the mapping before each forward")
        if (slices is not None and self.num_tokens <= NATIVE_MAX_TOKENS
                and _native_call(out, x, lora_a, lora_b, slices, self.token_slots)):
            return
        refuse_capture("LoRA through torch ops (their calls follow the step's mapping)")
        if not self.active_slots:
            return
        x = x.to(lora_a.dtype)
        if len(self.active_slots) == 1:
            slot = self.active_slots[0]
            shrink = x @ lora_a[slot].T                                      # [T, nR]
            if self.single_mask is not None:
                shrink.mul_(self.single_mask)
            _add_product(out, shrink, lora_b[slot])
            return
        if self.runs is not None:     # GEMM-sized steps: two products per adapter, in place
            for slot, start, end in self.runs:
                _add_product(out[start:end], x[start:end] @ lora_a[slot].T, lora_b[slot])
            return
        if self.slot_index is not None:
            lora_a = lora_a.index_select(0, self.slot_index)                 # [S, nR, in]
            lora_b = lora_b.index_select(0, self.slot_index)                 # [S, nR, out]
        xs = x.index_select(0, self.gather_index)                            # [S*Tmax, in]
        if self.gather_mask is not None:
            xs.mul_(self.gather_mask)
        xs = xs.view(lora_a.shape[0], self.max_group, -1)
        ys = torch.bmm(torch.bmm(xs, lora_a.transpose(1, 2)), lora_b)       # [S, Tmax, out]
        out.index_add_(0, self.gather_index, ys.view(-1, ys.shape[-1]).to(out.dtype))


def _contiguous_runs(token_slots: torch.Tensor, num_active: int
                     ) -> list[tuple[int, int, int]] | None:
    """(slot, start, end) of each active slot when its tokens form one run, else None."""
    change = torch.nonzero(token_slots[1:] != token_slots[:-1]).flatten() + 1
    starts = [0, *change.tolist()]
    ends = [*starts[1:], int(token_slots.numel())]
    slots = token_slots[torch.tensor(starts)].tolist()
    runs = [(s, a, b) for s, a, b in zip(slots, starts, ends) if s >= 0]
    return runs if len(runs) == num_active else None


def _native_call(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                 lora_b: torch.Tensor, slices: torch.Tensor, token_slots: torch.Tensor) -> bool:
    """The one-call kernel for bf16 on CPU; False (nothing done) where it does not apply."""
    bf16 = torch.bfloat16
    if not (out.dtype == x.dtype == lora_a.dtype == lora_b.dtype == bf16 and out.is_cpu
            and out.stride(-1) == 1 and x.stride(-1) == 1 and lora_a.is_contiguous()
            and lora_b.is_contiguous()):
        return False
    lib = ops.native_lib()
    if lib is None:
        return False
    num_loras, rank_rows, in_dim = lora_a.shape
    rc = lib.minivllm_lora_shrink_expand_bf16(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), lora_a.data_ptr(),
        lora_b.data_ptr(), token_slots.data_ptr(), slices.data_ptr(), x.shape[0],
        slices.shape[0], rank_rows // slices.shape[0], in_dim, out.shape[1], num_loras,
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"LoRA kernel failed ({rc}): a token's slot is outside the table")
    return True


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b in place."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out.add_((a @ b).to(out.dtype))
