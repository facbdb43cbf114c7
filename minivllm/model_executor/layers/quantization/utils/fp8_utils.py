"""fp8 helpers at vLLM's path (`quantization.utils.fp8_utils`)."""

import torch

from minivllm.model_executor.kernels.quant_linear import fp8_quant_groups


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int, eps: float = 1e-10,
                              dtype: torch.dtype | None = None,
                              column_major_scales: bool = False,
                              **unused: object) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of `group_size`) -> (e4m3 [..., K], fp32 scales [..., K/g]):
    each token's groups of `group_size` values scaled by their own absmax / 448."""
    if x.shape[-1] % group_size:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of "
                         f"group_size ({group_size})")
    if dtype not in (None, torch.float8_e4m3fn):
        raise ValueError(f"per_token_group_quant_fp8 makes float8_e4m3fn values, not {dtype}")
    q, scale = fp8_quant_groups(x.reshape(-1, x.shape[-1]), group_size, eps)
    scale = scale.reshape(*x.shape[:-1], -1)
    if column_major_scales:
        scale = scale.transpose(-1, -2).contiguous().transpose(-1, -2)
    return q.reshape(x.shape), scale
