"""RoPE on bf16 q/k rows in place: the native kernel (`csrc/rotary_embedding.cpp`), else None."""

import torch

from minivllm import _custom_ops as ops


def rotary_embedding_bf16(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                          cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                          is_neox_style: bool) -> bool:
    """Rotates query [T, nH * d] and key [T, nKV * d] (bf16, unit stride inside a row) in place
    by `cos_sin_cache` bf16 [max_position, rotary_dim] at int64 `positions` [T], with eager
    bf16's roundings. False (nothing changed) when the kernel cannot take these tensors."""
    lib = ops.native_lib() if query.is_cpu else None
    if (lib is None or query.dtype != torch.bfloat16 or query.dim() != 2
            or query.stride(1) != 1 or cos_sin_cache.dtype != torch.bfloat16
            or not cos_sin_cache.is_contiguous() or cos_sin_cache.shape[1] != rotary_dim
            or positions.dtype != torch.int64 or positions.dim() != 1
            or not positions.is_contiguous() or positions.shape[0] != query.shape[0]
            or query.shape[1] % head_size):
        return False
    if key is not None and (key.dtype != torch.bfloat16 or key.dim() != 2 or key.stride(1) != 1
                            or key.shape[0] != query.shape[0] or key.shape[1] % head_size):
        return False
    rc = lib.minivllm_rotary_embedding_bf16(
        positions.data_ptr(), positions.shape[0], query.data_ptr(), query.stride(0),
        query.shape[1] // head_size, None if key is None else key.data_ptr(),
        0 if key is None else key.stride(0), 0 if key is None else key.shape[1] // head_size,
        cos_sin_cache.data_ptr(), cos_sin_cache.shape[0], head_size, rotary_dim,
        int(is_neox_style), torch.get_num_threads())
    if rc == 2:
        raise ValueError(f"rotary embedding: a position is outside the cos/sin cache of "
                         f"{cos_sin_cache.shape[0]} positions (max_position_embeddings)")
    return rc == 0
