"""Embedding row lookups as one native call (`csrc/gather_rows.cpp`), else torch's index_select."""

import torch

from minivllm import _custom_ops as ops


def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table [V, D] (unit stride inside a row), int ids [...] -> table[ids] [*ids.shape, D].

    NOTE: the native copy exists so that a CPU graph can record the lookup that starts each
    decode step (torch's own index_select is as fast, but it is not a native call)."""
    lib = ops.native_lib() if table.is_cpu else None
    flat = ids.reshape(-1)
    if (lib is None or table.dim() != 2 or table.stride(1) != 1 or flat.dtype != torch.int64
            or not flat.is_contiguous() or torch.compiler.is_compiling()):
        return table.index_select(0, flat).reshape(*ids.shape, table.shape[1])
    out = table.new_empty(flat.shape[0], table.shape[1])
    row_bytes = table.shape[1] * table.element_size()
    rc = lib.minivllm_gather_rows(table.data_ptr(), table.stride(0) * table.element_size(),
                                  table.shape[0], flat.data_ptr(), flat.shape[0], row_bytes,
                                  out.data_ptr(), row_bytes)
    if rc != 0:
        raise IndexError(f"embedding id out of range: ids must be in [0, {table.shape[0]})")
    return out.reshape(*ids.shape, table.shape[1])
