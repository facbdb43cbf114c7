"""Small helpers: `divide`, `split_tensor_along_last_dim` and the pipeline layer partition."""

from collections.abc import Sequence

import torch

from minivllm import envs


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    """`num_partitions` equal views of `tensor` along its last dim (copies if `contiguous_...`)."""
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [start, end) of stage `pp_rank`.

    `VLLM_PP_LAYER_PARTITION="a,b,..."` fixes the split; otherwise each stage gets L // pp and
    the remainder goes to the stages before the last (-2, -3, ...): 10 layers, pp=4 -> 2,3,3,2.
    """
    partition = envs.VLLM_PP_LAYER_PARTITION
    if partition:
        try:
            sizes = [int(p) for p in partition.split(",")]
        except ValueError as err:
            raise ValueError(f"Invalid VLLM_PP_LAYER_PARTITION={partition!r}: expected "
                             "comma-separated integers") from err
        if len(sizes) != pp_size:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION has {len(sizes)} entries but "
                             f"pipeline_parallel_size is {pp_size}")
        if sum(sizes) != num_hidden_layers:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION sums to {sum(sizes)}, but the model has "
                             f"{num_hidden_layers} layers")
        if any(s < 1 for s in sizes):
            raise ValueError("every VLLM_PP_LAYER_PARTITION entry must be >= 1")
    else:
        sizes = [num_hidden_layers // pp_size] * pp_size
        for i in range(num_hidden_layers % pp_size):
            sizes[-2 - i if pp_size > 1 else 0] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]
