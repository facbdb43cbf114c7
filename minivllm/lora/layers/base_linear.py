"""BaseLinearLayerWithLoRA: a TP linear layer plus a slot table of adapters (vLLM's names).

The wrapper keeps the base layer (its weights, quant method and TP coordinates) as
`base_layer` and reproduces its forward with the LoRA delta added to the local output before
the layer's collective (the column-parallel gather, the row-parallel all-reduce), so the
partial products of a row-parallel layer are reduced together with the base layer's.

Tables, per layer (L = max_loras slots, R = max_lora_rank, n = packed slices):
    lora_a_stacked  [L, n*R, in_local]     slice k's A in rows [k*R, k*R + r)
    lora_b_stacked  [L, n*R, out_local]    slice k's B transposed (scaling folded in) in rows
                                           [k*R, k*R + r) and slice k's output columns
B is block-diagonal over the slices, so one product serves all of them (a packed layer costs
one shrink and one expand instead of one per slice; small products are dominated by their
per-call overhead on CPU). Unused rows and slots are zero, so a smaller rank or a slice the
adapter does not target adds exactly nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from minivllm.lora.punica_wrapper import PunicaWrapper


class BaseLinearLayerWithLoRA(nn.Module):
    """Shared tables and slot writes; subclasses say how A and B are sharded."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.tp_rank: int = base_layer.tp_rank
        self.tp_size: int = base_layer.tp_size
        self.punica_wrapper: PunicaWrapper | None = None

    # --- what subclasses define -----------------------------------------------------------

    @property
    def input_size_local(self) -> int:
        raise NotImplementedError

    def output_slices(self) -> list[tuple[int, int]]:
        """(offset, rows) of each packed slice in this rank's output."""
        raise NotImplementedError

    def global_slice_sizes(self) -> list[int]:
        """Rows of each slice in the full (unsharded) checkpoint matrix."""
        raise NotImplementedError

    def shard_lora_a(self, lora_a: torch.Tensor) -> torch.Tensor:
        return lora_a                          # [r, in] -> [r, in_local]

    def shard_lora_b(self, lora_b: torch.Tensor, slice_index: int) -> torch.Tensor:
        return lora_b                          # [o_k, r] -> [o_k_local, r]

    # --- tables ---------------------------------------------------------------------------

    @property
    def num_slices(self) -> int:
        return len(self.output_slices())

    def create_lora_weights(self, max_loras: int, max_rank: int, dtype: torch.dtype,
                            punica_wrapper: PunicaWrapper) -> None:
        self.punica_wrapper = punica_wrapper
        self.max_rank = max_rank
        n = self.num_slices
        out_local = sum(size for _, size in self.output_slices())
        self.register_buffer("lora_a_stacked", torch.zeros(
            max_loras, n * max_rank, self.input_size_local, dtype=dtype), persistent=False)
        self.register_buffer("lora_b_stacked", torch.zeros(
            max_loras, n * max_rank, out_local, dtype=dtype), persistent=False)
        self.lora_slices = torch.tensor(self.output_slices(), dtype=torch.int64)   # [n, 2]

    def reset_lora(self, slot: int) -> None:
        self.lora_a_stacked[slot].zero_()
        self.lora_b_stacked[slot].zero_()

    def set_lora(self, slot: int, slices: list[Any]) -> None:
        """Write one adapter's full-size weights (a LoRALayerWeights or None per slice) into
        `slot`, keeping this rank's shard."""
        self.reset_lora(slot)
        rank = self.max_rank
        for k, ((offset, size), weights) in enumerate(zip(self.output_slices(), slices)):
            if weights is None:
                continue
            r = weights.lora_a.shape[0]
            a = self.shard_lora_a(weights.lora_a)                   # [r, in_local]
            b = self.shard_lora_b(weights.lora_b, k)                # [o_k_local, r]
            self.lora_a_stacked[slot, k * rank:k * rank + r].copy_(a)
            self.lora_b_stacked[slot, k * rank:k * rank + r, offset:offset + size].copy_(b.T)

    def apply_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + delta for this step's mapping; x [..., in_local], out [..., out_local]."""
        punica = self.punica_wrapper
        if punica is None:
            return out
        if not out.is_contiguous():
            out = out.contiguous()
        punica.add_lora_linear(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]),
                               self.lora_a_stacked, self.lora_b_stacked, self.lora_slices)
        return out

    def __getattr__(self, name: str) -> Any:
        # Model code reads the base layer's attributes (e.g. `qkv_proj.output_sizes`).
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base_layer"), name)

    def extra_repr(self) -> str:
        return f"slices={self.num_slices}"
