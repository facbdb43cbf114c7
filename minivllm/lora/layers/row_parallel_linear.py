"""LoRA on row-parallel layers: A sharded by input columns, B whole on every rank.

Rank r computes `B (A_r x_r)`, a partial sum like the base layer's `W_r x_r`; both are added
before the one all-reduce, which sums `B (sum_r A_r x_r) = B A x`.
"""

from __future__ import annotations

import torch

from minivllm.distributed import tensor_model_parallel_all_reduce
from minivllm.lora.layers.base_linear import BaseLinearLayerWithLoRA


class RowParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    @property
    def input_size_local(self) -> int:
        return self.base_layer.input_size_per_partition

    def output_slices(self) -> list[tuple[int, int]]:
        return [(0, self.base_layer.output_size)]

    def global_slice_sizes(self) -> list[int]:
        return [self.base_layer.output_size]

    def shard_lora_a(self, lora_a: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return lora_a
        size = self.input_size_local
        return lora_a.narrow(1, self.tp_rank * size, size)

    def forward(self, x: torch.Tensor):
        base = self.base_layer
        if not base.input_is_parallel and base.tp_size > 1:
            x = x.chunk(base.tp_size, dim=-1)[base.tp_rank]        # [..., in/T]
        bias = base.bias if base.tp_rank == 0 and not base.skip_bias_add else None
        output = base.quant_method.apply(base, x, bias)            # [..., out], partial at T > 1
        output = self.apply_lora(x, output)
        if base.reduce_results and base.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output)
        return base._output(output)
