"""LoRA on column-parallel layers: A whole on every rank, B sharded by output rows, per slice.

Rank r holds the same rows of each slice's B as the base layer holds of that slice's weight:
`[r*o/T, (r+1)*o/T)` for a plain or merged (gate_up) layer, the rank's heads for q / k / v
(replicated KV heads included).
"""

from __future__ import annotations

import torch

from minivllm.distributed import tensor_model_parallel_all_gather
from minivllm.lora.layers.base_linear import BaseLinearLayerWithLoRA


class ColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    @property
    def input_size_local(self) -> int:
        return self.base_layer.input_size

    def output_slices(self) -> list[tuple[int, int]]:
        return [(0, self.base_layer.output_size_per_partition)]

    def global_slice_sizes(self) -> list[int]:
        return [self.base_layer.output_size]

    def _slice_source_rows(self, slice_index: int) -> tuple[int, int]:
        """(first row, rows) of this rank's shard inside the full matrix of slice k."""
        size = self.output_slices()[slice_index][1]
        return self.tp_rank * size, size

    def shard_lora_b(self, lora_b: torch.Tensor, slice_index: int) -> torch.Tensor:
        if self.tp_size == 1:
            return lora_b
        start, size = self._slice_source_rows(slice_index)
        return lora_b.narrow(0, start, size)

    def forward(self, x: torch.Tensor):
        base = self.base_layer
        bias = base.bias if not base.skip_bias_add else None
        output = base.quant_method.apply(base, x, bias)         # [..., out/T]
        output = self.apply_lora(x, output)
        if base.gather_output and base.tp_size > 1:
            output = tensor_model_parallel_all_gather(output)    # [..., out]
        return base._output(output)


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """gate_up_proj: one slice per logical matrix."""

    def output_slices(self) -> list[tuple[int, int]]:
        sizes = self.base_layer.output_sizes
        tp = self.tp_size
        return [(sum(sizes[:k]) // tp, size // tp) for k, size in enumerate(sizes)]

    def global_slice_sizes(self) -> list[int]:
        return list(self.base_layer.output_sizes)


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """qkv_proj: q, k, v slices; each rank's B rows follow the base layer's head split."""

    def output_slices(self) -> list[tuple[int, int]]:
        return [self.base_layer._shard_layout(s)[:2] for s in ("q", "k", "v")]

    def global_slice_sizes(self) -> list[int]:
        base = self.base_layer
        kv = base.total_num_kv_heads
        return [base.total_num_heads * base.head_size, kv * base.head_size, kv * base.v_head_size]

    def _slice_source_rows(self, slice_index: int) -> tuple[int, int]:
        _, size, start = self.base_layer._shard_layout(("q", "k", "v")[slice_index])
        return start, size
