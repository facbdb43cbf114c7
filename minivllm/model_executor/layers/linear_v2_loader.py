"""The linear layers' `weight_loader_v2` bodies (contract §2.1): shard offsets for v2 parameters.

A v2 parameter (`parameter.BasevLLMParameter`) narrows the checkpoint tensor itself; the layer only
says where each logical matrix goes. Offsets and sizes are local rows of this rank, in the
parameter's own units: divided by `packed_factor` along a packed dim (the parameter does that),
in blocks for `BlockQuantScaleParameter` (done here, from `layer.weight_block_size`).
"""

from typing import Any

import torch
import torch.nn as nn

from minivllm.model_executor.parameter import (WEIGHT_LOADER_V2_SUPPORTED, BasevLLMParameter,
                                              BlockQuantScaleParameter, PerTensorScaleParameter,
                                              RowvLLMParameter)


def uses_weight_loader_v2(quant_method: Any) -> bool:
    """Whether a layer with this quant method hands `weight_loader_v2` to `create_weights`."""
    return type(quant_method).__name__ in WEIGHT_LOADER_V2_SUPPORTED


def _as_1d(loaded_weight: torch.Tensor) -> torch.Tensor:
    # Scalars on disk (per-tensor fp8 scales) arrive as []; parameters hold [1].
    return loaded_weight.reshape(1) if loaded_weight.dim() == 0 else loaded_weight


def load_replicated(param: BasevLLMParameter, loaded_weight: torch.Tensor) -> None:
    """ReplicatedLinear: the whole tensor on every rank, whatever the TP size."""
    BasevLLMParameter._assert_and_load(param, _as_1d(loaded_weight))


def load_column(param: BasevLLMParameter, loaded_weight: torch.Tensor) -> None:
    param.load_column_parallel_weight(_as_1d(loaded_weight))


def load_row(param: BasevLLMParameter, loaded_weight: torch.Tensor) -> None:
    param.load_row_parallel_weight(_as_1d(loaded_weight))


def _to_blocks(layer: nn.Module, rows: int) -> int:
    block_n = layer.weight_block_size[0]
    return (rows + block_n - 1) // block_n


def _in_param_units(layer: nn.Module, param: BasevLLMParameter, rows: int) -> int:
    """Global rows of a logical matrix -> rows of `param` (blocks, or packed elements)."""
    if isinstance(param, BlockQuantScaleParameter):
        return _to_blocks(layer, rows)
    if getattr(param, "packed_dim", None) == getattr(param, "output_dim", None):
        return rows // param.packed_factor
    return rows


def _whole_tensor_param(param: BasevLLMParameter) -> bool:
    # Parameters with no output dim (replicated scalars, row-sharded tensors) take fused tensors whole.
    return type(param) in (BasevLLMParameter, RowvLLMParameter)


def load_merged_column(layer: nn.Module, param: BasevLLMParameter, loaded_weight: torch.Tensor,
                       loaded_shard_id: int | tuple[int, ...] | None) -> None:
    """MergedColumnParallelLinear: shard k at local offset `sum(sizes[:k]) / T`."""
    layer._validate_shard_id(loaded_shard_id)
    sizes = layer.output_sizes
    if loaded_shard_id is None or isinstance(loaded_shard_id, tuple):
        ids = tuple(range(len(sizes))) if loaded_shard_id is None else loaded_shard_id
        if isinstance(param, PerTensorScaleParameter):
            for shard in ids:    # one scale fused on disk applies to every matrix it covers
                param.load_merged_column_weight(loaded_weight, shard_id=shard)
            return
        if _whole_tensor_param(param):
            param.load_merged_column_weight(loaded_weight)
            return
        offset = 0
        for shard in ids:   # fused on disk: cut at the global sizes, load each matrix alone
            size = _in_param_units(layer, param, sizes[shard])
            load_merged_column(layer, param, loaded_weight.narrow(param.output_dim, offset, size),
                               shard)
            offset += size
        return
    tp_size = layer.tp_size
    if isinstance(param, BlockQuantScaleParameter):
        shard_offset = _to_blocks(layer, sum(sizes[:loaded_shard_id])) // tp_size
        shard_size = _to_blocks(layer, sizes[loaded_shard_id]) // tp_size
    else:
        shard_offset = sum(sizes[:loaded_shard_id]) // tp_size
        shard_size = sizes[loaded_shard_id] // tp_size
    param.load_merged_column_weight(loaded_weight=_as_1d(loaded_weight), shard_id=loaded_shard_id,
                                    shard_offset=shard_offset, shard_size=shard_size,
                                    tp_rank=layer.tp_rank)


def load_qkv(layer: nn.Module, param: BasevLLMParameter, loaded_weight: torch.Tensor,
             loaded_shard_id: str | None) -> None:
    """QKVParallelLinear: local rows `[q_r | k_r | v_r]`; KV blocks read at `r // replicas`."""
    layer._validate_shard_id(loaded_shard_id)
    if loaded_shard_id is None:
        if isinstance(param, PerTensorScaleParameter):
            param.load_qkv_weight(loaded_weight, shard_id=None)
            return
        if _whole_tensor_param(param):
            param.load_qkv_weight(loaded_weight)
            return
        q_rows = layer.total_num_heads * layer.head_size
        k_rows = layer.total_num_kv_heads * layer.head_size
        v_rows = layer.total_num_kv_heads * layer.v_head_size
        offset = 0
        for shard, rows in (("q", q_rows), ("k", k_rows), ("v", v_rows)):
            size = _in_param_units(layer, param, rows)
            load_qkv(layer, param, loaded_weight.narrow(param.output_dim, offset, size), shard)
            offset += size
        return
    shard_offset, shard_size, _ = layer._shard_layout(loaded_shard_id)
    if isinstance(param, BlockQuantScaleParameter):
        shard_offset, shard_size = _to_blocks(layer, shard_offset), _to_blocks(layer, shard_size)
    param.load_qkv_weight(loaded_weight=_as_1d(loaded_weight), shard_id=loaded_shard_id,
                          shard_offset=shard_offset, shard_size=shard_size,
                          num_heads=layer.num_kv_head_replicas, tp_rank=layer.tp_rank)
