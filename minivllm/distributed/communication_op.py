"""Tensor-parallel collectives that layers call (identity at TP size 1)."""

import torch

from minivllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return get_tp_group().all_gather(x, dim)


def tensor_model_parallel_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    return get_tp_group().gather(x, dst, dim)
