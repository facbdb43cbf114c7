"""Tensor-parallel collectives that layers call (identity at TP size 1)."""

import torch
import torch.distributed as dist

from minivllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return get_tp_group().all_gather(x, dim)


def tensor_model_parallel_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    return get_tp_group().gather(x, dst, dim)


def tensor_model_parallel_reduce_scatter(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum `x` over the TP group and keep this rank's 1/TP slice of `dim` (sizes must divide)."""
    group = get_tp_group()
    if group.world_size == 1:
        return x
    dim = dim % x.dim()
    if dist.get_backend(group.device_group) == "nccl":
        out_shape = list(x.shape)
        out_shape[dim] //= group.world_size
        # reduce_scatter_tensor splits dim 0: move `dim` to the front and back again.
        src = x.movedim(dim, 0).contiguous()
        out = src.new_empty([out_shape[dim], *src.shape[1:]])
        dist.reduce_scatter_tensor(out, src, group=group.device_group)
        return out.movedim(0, dim)
    # NOTE: gloo has no reduce-scatter; a full all-reduce then the local slice gives the same sum.
    summed = group.all_reduce(x)
    return summed.chunk(group.world_size, dim=dim)[group.rank_in_group].contiguous()
