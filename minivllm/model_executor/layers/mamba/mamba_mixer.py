"""`MambaMixer`: Mamba-1's selective state-space mixer (Mamba, Falcon-Mamba, Jamba), a
recurrent-state layer.

    x, z = in_proj(h)                   [T, I] each (this TP rank's I / tp channels)
    x = act(conv1d(x))                  causal depthwise convolution per sequence, from its state
    dt, B, C = x_proj(x)                [T, R], [T, N], [T, N] (all-reduced: x_proj is row-parallel)
    dt = softplus(dt_proj(dt) + bias)   [T, I]; dt / B / C RMS-normalised first when asked
    y = scan(x, dt, A, B, C) + D x      per channel, N state entries each (ops/mamba_ssm.py)
    out = out_proj(y * silu(z))

Each running sequence has a state slot (the forward context's `state_metadata` says which):
conv_state [slots, K - 1, I / tp] and ssm_state [slots, I / tp, N]. Tensor parallelism
splits the channels.
"""

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import get_current_vllm_config
from minivllm.distributed import get_tensor_model_parallel_world_size
from minivllm.forward_context import get_forward_context, is_forward_context_available
from minivllm.model_executor.layers.activation import get_act_fn
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear, RowParallelLinear)
from minivllm.model_executor.layers.mamba.mamba_utils import (MambaStateDtypeCalculator,
                                                              MambaStateShapeCalculator,
                                                              register_state_buffers)
from minivllm.model_executor.layers.mamba.ops.causal_conv1d import (causal_conv1d_varlen,
                                                                single_sequence_metadata)
from minivllm.model_executor.layers.mamba.ops.mamba_ssm import selective_scan_varlen
from minivllm.model_executor.parameter import (composed_weight_loader, set_weight_attrs,
                                               sharded_weight_loader)


class MambaMixer(nn.Module):
    """hidden [T, hidden_size] -> [T, hidden_size] (out_proj all-reduced over TP), written into
    `output` when one is given (vLLM's calling convention) and returned."""

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int,
                 intermediate_size: int, time_step_rank: int, use_conv_bias: bool,
                 use_bias: bool, use_rms_norm: bool, rms_norm_has_weight: bool = True,
                 rms_norm_eps: float = 1e-5, activation: str = "silu",
                 is_lora_enabled: bool = False, model_config: object = None,
                 cache_config: object = None, prefix: str = "") -> None:
        super().__init__()
        tp = self.tp_size = get_tensor_model_parallel_world_size()
        if intermediate_size % tp:
            raise ValueError(f"{prefix}: intermediate_size ({intermediate_size}) must be "
                             f"divisible by the tensor parallel size ({tp})")
        self.time_step_rank, self.ssm_state_size = time_step_rank, ssm_state_size
        self.conv_kernel_size, self.intermediate_size = conv_kernel_size, intermediate_size
        self.use_rms_norm, self.activation, self.prefix = use_rms_norm, activation, prefix
        self.is_lora_enabled = is_lora_enabled
        self.conv1d = ColumnParallelLinear(conv_kernel_size, intermediate_size,
                                           bias=use_conv_bias, prefix=f"{prefix}.conv1d")
        # The checkpoint's conv weight is [I, 1, K].
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)
        self.in_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                  bias=use_bias, prefix=f"{prefix}.in_proj")
        self.x_proj = RowParallelLinear(intermediate_size, time_step_rank + 2 * ssm_state_size,
                                        bias=False, prefix=f"{prefix}.x_proj")
        # Its bias is added inside the scan, before the softplus (hence skip_bias_add).
        self.dt_proj = ColumnParallelLinear(time_step_rank, intermediate_size, bias=True,
                                            skip_bias_add=True, prefix=f"{prefix}.dt_proj")
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, bias=use_bias,
                                          input_is_parallel=True, prefix=f"{prefix}.out_proj")
        local = intermediate_size // tp
        # Checkpoints hold A_log (model files rename it to A): A = -exp(A_log), [I / tp, N].
        self.A = nn.Parameter(torch.empty(local, ssm_state_size, dtype=torch.float32),
                              requires_grad=False)
        self.D = nn.Parameter(torch.ones(local), requires_grad=False)
        set_weight_attrs(self.A, {"weight_loader": composed_weight_loader(
            sharded_weight_loader(0), lambda a: -torch.exp(a.float()))})
        set_weight_attrs(self.D, {"weight_loader": sharded_weight_loader(0)})
        norms = {name: RMSNorm(size, eps=rms_norm_eps, has_weight=rms_norm_has_weight)
                 if use_rms_norm else None
                 for name, size in (("dt_layernorm", time_step_rank),
                                    ("b_layernorm", ssm_state_size),
                                    ("c_layernorm", ssm_state_size))}
        for name, norm in norms.items():
            setattr(self, name, norm)
        self.act = get_act_fn(activation)
        self.model_config, self.cache_config = model_config, cache_config
        self._alloc_state(get_current_vllm_config())

    def _alloc_state(self, vllm_config: object) -> None:
        conv_shape, ssm_shape = self.get_state_shape()
        cache = vllm_config.cache_config
        conv_dtype, ssm_dtype = MambaStateDtypeCalculator.mamba1_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)
        register_state_buffers(self, vllm_config, {"conv_state": (conv_shape, conv_dtype),
                                                   "ssm_state": (ssm_shape, ssm_dtype)})

    def get_state_shape(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return MambaStateShapeCalculator.mamba1_state_shape(
            self.tp_size, self.intermediate_size, self.ssm_state_size, self.conv_kernel_size)

    def _ssm_transform(self, x: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, I / tp] -> dt [T, I / tp] (before bias and softplus), B / C [T, N]."""
        params, _ = self.x_proj(x)                                     # [T, R + 2N]
        dt, b, c = params.split([self.time_step_rank, self.ssm_state_size,
                                 self.ssm_state_size], dim=-1)
        if self.use_rms_norm:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        dt, _ = self.dt_proj(dt)
        return dt, b, c

    def forward(self, hidden_states: torch.Tensor,
                output: torch.Tensor | None = None) -> torch.Tensor:
        md = (get_forward_context().state_metadata if is_forward_context_available()
              else None)
        proj, _ = self.in_proj(hidden_states)                         # [T, 2 I / tp]
        x, gate = proj.chunk(2, dim=-1)
        weight = self.conv1d.weight.view(self.conv1d.weight.shape[0], -1)  # [I / tp, K]
        x = self.act(causal_conv1d_varlen(x, weight, self.conv1d.bias, self.conv_state, md))
        dt, b, c = self._ssm_transform(x.to(hidden_states.dtype))
        dt = F.softplus(dt.float() + self.dt_proj.bias.float())
        write_state = md is not None
        if md is None:                 # a dummy / profiling run: one stateless sequence
            md = single_sequence_metadata(x.shape[0])
        y = selective_scan_varlen(x.float(), dt, self.A.float(), b.float(), c.float(),
                                  self.D.float(), gate.float(), self.ssm_state, md,
                                  write_state)                          # [T, I / tp] fp32
        out, _ = self.out_proj(y.to(hidden_states.dtype))
        if output is not None:
            output.copy_(out)
            return output
        return out
