"""`ShortConv`: LFM2's gated short convolution, a recurrent-state mixer.

    B, C, x = in_proj(h)                    [T, H] each (this TP rank's channels)
    u = B * x;  y = C * conv(u);  out = out_proj(y)

`conv` is a causal depthwise convolution of kernel K over each sequence's u. Its state is the
sequence's last K - 1 values of u, one row of `conv_state` [num_slots, K - 1, H] per running
sequence (`worker/state_slots.py` hands out the rows; the forward context's `state_metadata`
says which row each scheduled sequence has and whether it starts fresh). A step may mix
prefills, prompt chunks and decodes: the convolution runs on all of them at once, over an
extended copy of u in which every sequence's tokens follow its K - 1 state rows.
"""

from typing import Any

import torch
from torch import nn

from minivllm.config import get_current_vllm_config
from minivllm.distributed import get_tensor_model_parallel_world_size
from minivllm.forward_context import get_forward_context, is_forward_context_available
from minivllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.parameter import set_weight_attrs, sharded_weight_loader
from minivllm.model_executor.layers.mamba.mamba_utils import (MambaStateDtypeCalculator,
                                                              MambaStateShapeCalculator,
                                                              register_state_buffers)
from minivllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_varlen
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata


class _DepthwiseConv(nn.Module):
    """The checkpoint's `conv`: weight [H, 1, K] (and bias [H]), this rank's channels."""

    def __init__(self, channels: int, kernel_size: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False)
        rows = sharded_weight_loader(0)
        # llama.cpp's GGUF files store it squeezed, [H, K].
        set_weight_attrs(self.weight, {"weight_loader": lambda param, w: rows(
            param, w.view(w.shape[0], 1, -1))})
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(channels), requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": sharded_weight_loader(0)})


class ShortConv(nn.Module):
    """hidden [T, H] -> [T, H] (out_proj all-reduced over TP)."""

    def __init__(self, config: Any, dim: int, layer_idx: int, model_config: Any = None,
                 cache_config: Any = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        if dim % tp:
            raise ValueError(f"hidden_size ({dim}) must be divisible by the tensor parallel "
                             f"size ({tp})")
        self.layer_idx, self.prefix = layer_idx, prefix
        self.kernel_size = config.conv_L_cache
        bias = bool(getattr(config, "conv_bias", False))
        self.in_proj = MergedColumnParallelLinear(dim, [dim] * 3, bias=bias,
                                                  quant_config=quant_config,
                                                  prefix=f"{prefix}.in_proj")
        self.out_proj = RowParallelLinear(dim, dim, bias=bias, quant_config=quant_config,
                                          prefix=f"{prefix}.out_proj")
        self.conv = _DepthwiseConv(dim // tp, self.kernel_size, bias)
        vllm_config = get_current_vllm_config()
        (shape,) = MambaStateShapeCalculator.short_conv_state_shape(tp, dim, self.kernel_size)
        (dtype,) = MambaStateDtypeCalculator.short_conv_state_dtype(
            vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype)
        register_state_buffers(self, vllm_config, {"conv_state": (shape, dtype)})

    def forward(self, hidden_states: torch.Tensor,
                output: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM's files pass `output` [T, H] and read the result from it (its custom-op
        form); minivllm's own lfm2.py takes the returned tensor. Both get the same values."""
        md = (get_forward_context().state_metadata if is_forward_context_available()
              else None)
        bcx, _ = self.in_proj(hidden_states)                # [T, 3H]
        b, c, x = bcx.chunk(3, dim=-1)
        y = c * self._conv(b * x, md)                       # [T, H]
        out, _ = self.out_proj(y)
        if output is not None:
            output.copy_(out)
        return out

    def _conv(self, u: torch.Tensor, md: ShortConvAttentionMetadata | None) -> torch.Tensor:
        """Causal depthwise convolution of u [T, H] per sequence, from and into its state."""
        weight = self.conv.weight.view(-1, self.kernel_size)                 # [H, K]
        return causal_conv1d_varlen(u, weight, self.conv.bias, self.conv_state, md).to(u.dtype)
