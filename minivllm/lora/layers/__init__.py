"""LoRA wrappers of the tensor-parallel linear layers, and which wrapper serves which layer."""

from torch import nn

from minivllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
from minivllm.lora.layers.column_parallel_linear import (ColumnParallelLinearWithLoRA,
                                                         MergedColumnParallelLinearWithLoRA,
                                                         QKVParallelLinearWithLoRA)
from minivllm.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA
from minivllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)

# Exact types only: a subclass may compute something else in its own forward.
_LORA_CLASSES: dict[type, type[BaseLinearLayerWithLoRA]] = {
    ColumnParallelLinear: ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinear: MergedColumnParallelLinearWithLoRA,
    QKVParallelLinear: QKVParallelLinearWithLoRA,
    RowParallelLinear: RowParallelLinearWithLoRA,
}


def from_layer(layer: nn.Module) -> BaseLinearLayerWithLoRA | None:
    """The LoRA wrapper of `layer`, or None when LoRA cannot wrap its type."""
    cls = _LORA_CLASSES.get(type(layer))
    return cls(layer) if cls is not None else None


__all__ = ["BaseLinearLayerWithLoRA", "ColumnParallelLinearWithLoRA",
           "MergedColumnParallelLinearWithLoRA", "QKVParallelLinearWithLoRA",
           "RowParallelLinearWithLoRA", "from_layer"]
