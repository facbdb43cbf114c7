"""`MambaMixer2`: Mamba-2's selective state-space mixer (Mamba2, Granite-4.0-H, Falcon-H1,
Zamba2, Nemotron-H), a recurrent-state layer.

    z, xBC, dt = in_proj(h)         [T, I], [T, I + 2GN], [T, H] (this TP rank's share)
    x, B, C = silu(conv1d(xBC))     causal depthwise convolution per sequence, from its state
    y = SSD(x, dt, A, B, C) + D x   per head: H heads of P = I / H channels, N state entries
    out = out_proj(norm(y, gate=z)) the gated RMSNorm is taken per group of I / G channels

Each running sequence has a state slot (`worker/state_slots.py`; the forward context's
`state_metadata` says which): conv_state [slots, K - 1, I + 2GN] and ssm_state [slots, H, P, N].
Tensor parallelism splits heads (and their channels); the G groups of B / C are split with
them, or, for a single group, copied to every rank.
"""

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import get_current_vllm_config
from minivllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size,
                                  tensor_model_parallel_all_reduce)
from minivllm.distributed.utils import divide
from minivllm.forward_context import get_forward_context, is_forward_context_available
from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.layers.activation import get_act_fn
from minivllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear, RowParallelLinear)
from minivllm.model_executor.layers.mamba.mamba_utils import (MambaStateDtypeCalculator,
                                                              MambaStateShapeCalculator,
                                                              register_state_buffers)
from minivllm.model_executor.layers.mamba.ops.causal_conv1d import (causal_conv1d_varlen,
                                                                single_sequence_metadata)
from minivllm.model_executor.layers.mamba.ops.ssd import mamba_chunk_scan_varlen
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.parameter import (LoaderFunction, composed_weight_loader,
                                               set_weight_attrs, sharded_weight_loader)


class Mixer2RMSNormGated(CustomOp):
    """x * silu(gate), RMS-normalised over groups of full_hidden_size / full_n_groups channels
    (a single group spans the TP ranks: its sum of squares is all-reduced), times the weight.
    x, gate [T, I / tp]."""

    def __init__(self, full_hidden_size: int, full_n_groups: int, use_rms_norm: bool = True,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.group_size = full_hidden_size // full_n_groups
        self.n_groups = full_n_groups
        if full_n_groups != 1 and full_n_groups % self.tp_size:
            raise ValueError(f"n_groups={full_n_groups} cannot be split over tensor parallel "
                             f"size {self.tp_size}")
        self.variance_epsilon = eps
        self.use_rms_norm = use_rms_norm
        if use_rms_norm:
            self.weight = nn.Parameter(torch.ones(divide(full_hidden_size, self.tp_size)))
            set_weight_attrs(self.weight, {"weight_loader": sharded_weight_loader(0)})
        else:
            self.register_parameter("weight", None)

    def forward_native(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(gate.float())
        if not self.use_rms_norm:
            return x.to(dtype)
        if self.n_groups == 1 and self.tp_size > 1:
            sq = tensor_model_parallel_all_reduce(x.pow(2).sum(-1, keepdim=True))
            x = x * torch.rsqrt(sq / (x.shape[-1] * self.tp_size) + self.variance_epsilon)
        else:
            groups = x.view(*x.shape[:-1], -1, self.group_size)          # [T, G/tp, I/G]
            var = groups.pow(2).mean(-1, keepdim=True)
            x = (groups * torch.rsqrt(var + self.variance_epsilon)).view(x.shape)
        return self.weight * x.to(dtype)


def mamba_v2_sharded_weight_loader(segments: list[tuple[int, bool]], tp_size: int,
                                   tp_rank: int) -> LoaderFunction:
    """A loader of a fused tensor made of `segments` stacked on dim 0, each (checkpoint rows,
    replicated): a rank takes its 1/tp of every segment's rows, or all of a replicated one
    (the single group of B / C that every head shard needs)."""
    def loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        dst, src = 0, 0
        for rows, replicated in segments:
            take = rows if replicated else rows // tp_size
            start = src + (0 if replicated else tp_rank * take)
            param.data[dst:dst + take].copy_(
                loaded_weight[start:start + take].view_as(param.data[dst:dst + take]))
            dst, src = dst + take, src + rows
        if dst != param.shape[0] or src != loaded_weight.shape[0]:
            raise ValueError(f"fused Mamba tensor of {loaded_weight.shape[0]} rows does not "
                             f"match its segments {segments}")
    return loader


class MambaMixer2(nn.Module):
    """hidden [T, hidden_size] -> [T, hidden_size] (out_proj all-reduced over TP)."""

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int,
                 intermediate_size: int, use_conv_bias: bool, use_bias: bool,
                 n_groups: int = 1, num_heads: int = 128, head_dim: int = 64,
                 rms_norm_eps: float = 1e-5, activation: str = "silu",
                 use_rms_norm: bool = True, model_config: object = None,
                 cache_config: object = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        tp = self.tp_size = get_tensor_model_parallel_world_size()
        if num_heads % tp:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by the tensor "
                             f"parallel size ({tp})")
        self.ssm_state_size, self.conv_kernel_size = ssm_state_size, conv_kernel_size
        self.intermediate_size, self.num_heads, self.head_dim = intermediate_size, num_heads, \
            head_dim
        self.activation, self.prefix = activation, prefix
        self.n_groups = n_groups + MambaStateShapeCalculator.extra_groups_for_head_shards(
            n_groups, tp)
        self.groups_ssm_state_size = self.n_groups * ssm_state_size
        self.conv_dim = intermediate_size + 2 * self.groups_ssm_state_size
        self._build_projections(hidden_size, n_groups, use_conv_bias, use_bias, quant_config)
        self._build_ssm_params(num_heads // tp)
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, bias=use_bias,
                                          input_is_parallel=True, quant_config=quant_config,
                                          prefix=f"{prefix}.out_proj")
        self.norm = Mixer2RMSNormGated(intermediate_size, n_groups, use_rms_norm,
                                       eps=rms_norm_eps)
        self.act = get_act_fn(activation)
        self._alloc_state(get_current_vllm_config(), n_groups)

    def _build_projections(self, hidden_size: int, n_groups: int, use_conv_bias: bool,
                           use_bias: bool, quant_config: QuantizationConfig | None) -> None:
        """conv1d (a [conv_dim, 1, K] weight, held by a linear layer for its TP loader) and
        in_proj [z | x | B | C | dt]. A single group copied to every rank needs a loader that
        reads the fused tensors segment by segment."""
        inter, gss, prefix = self.intermediate_size, self.groups_ssm_state_size, self.prefix
        k = self.conv_kernel_size
        if n_groups % self.tp_size == 0:
            self.conv1d = MergedColumnParallelLinear(k, [inter, gss, gss], bias=use_conv_bias,
                                                     prefix=f"{prefix}.conv1d")
            self.in_proj = MergedColumnParallelLinear(
                hidden_size, [inter, inter, gss, gss, self.num_heads], bias=use_bias,
                quant_config=quant_config, prefix=f"{prefix}.in_proj")
        else:
            if quant_config is not None:
                raise ValueError(f"{prefix}: a quantized in_proj with one SSM group cannot be "
                                 f"split over tensor parallel size {self.tp_size}; use -tp 1")
            self.conv1d = ColumnParallelLinear(k, self.conv_dim, bias=use_conv_bias,
                                               prefix=f"{prefix}.conv1d")
            self.in_proj = ColumnParallelLinear(
                hidden_size, inter + self.conv_dim + self.num_heads, bias=use_bias,
                prefix=f"{prefix}.in_proj")
            ckpt_gss = n_groups * self.ssm_state_size
            conv_segments = [(inter, False), (ckpt_gss, True), (ckpt_gss, True)]
            proj_segments = [(inter, False)] + conv_segments + [(self.num_heads, False)]
            rank = get_tensor_model_parallel_rank()
            for param, segments in ((self.conv1d.weight, conv_segments),
                                    (self.conv1d.bias, conv_segments),
                                    (self.in_proj.weight, proj_segments),
                                    (self.in_proj.bias, proj_segments)):
                if param is not None:
                    del param.weight_loader
                    set_weight_attrs(param, {"weight_loader": mamba_v2_sharded_weight_loader(
                        segments, self.tp_size, rank)})
        # The checkpoint's conv weight is [conv_dim, 1, K].
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)

    def _build_ssm_params(self, local_heads: int) -> None:
        self.A = nn.Parameter(torch.empty(local_heads, dtype=torch.float32),
                              requires_grad=False)
        self.D = nn.Parameter(torch.ones(local_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(local_heads), requires_grad=False)
        # Checkpoints hold A_log (model files rename it to A): A = -exp(A_log).
        set_weight_attrs(self.A, {"weight_loader": composed_weight_loader(
            sharded_weight_loader(0), lambda a: -torch.exp(a.float()))})
        set_weight_attrs(self.D, {"weight_loader": sharded_weight_loader(0)})
        set_weight_attrs(self.dt_bias, {"weight_loader": sharded_weight_loader(0)})

    def _alloc_state(self, vllm_config: object, n_groups: int) -> None:
        conv_shape, ssm_shape = MambaStateShapeCalculator.mamba2_state_shape(
            self.tp_size, self.intermediate_size, n_groups, self.num_heads, self.head_dim,
            self.ssm_state_size, self.conv_kernel_size)
        cache = vllm_config.cache_config
        conv_dtype, ssm_dtype = MambaStateDtypeCalculator.mamba2_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)
        register_state_buffers(self, vllm_config, {"conv_state": (conv_shape, conv_dtype),
                                                   "ssm_state": (ssm_shape, ssm_dtype)})

    def forward(self, hidden_states: torch.Tensor,
                mup_vector: torch.Tensor | None = None) -> torch.Tensor:
        md = (get_forward_context().state_metadata if is_forward_context_available()
              else None)
        proj, _ = self.in_proj(hidden_states)                         # [T, I + conv + H]
        if mup_vector is not None:                                    # Falcon-H1's multipliers
            proj = proj * mup_vector
        inter, heads = self.intermediate_size // self.tp_size, self.num_heads // self.tp_size
        gate, xbc, dt = proj.split([inter, self.conv_dim // self.tp_size, heads], dim=-1)
        weight = self.conv1d.weight.view(self.conv1d.weight.shape[0], -1)   # [conv, K]
        xbc = self.act(causal_conv1d_varlen(xbc, weight, self.conv1d.bias,
                                            self.conv_state, md))       # [T, conv] fp32
        gss = self.groups_ssm_state_size // self.tp_size
        x, b, c = xbc.split([inter, gss, gss], dim=-1)
        y = self._ssm(x, b, c, dt, md)                                 # [T, I] fp32
        hidden = self.norm(y.to(hidden_states.dtype), gate)
        out, _ = self.out_proj(hidden)
        return out

    def _ssm(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor,
             md: object) -> torch.Tensor:
        """The scan in fp32: x [T, I], b / c [T, G*N] (this rank's), dt [T, H]."""
        num_tokens = x.shape[0]
        heads = self.num_heads // self.tp_size
        groups = self.n_groups // self.tp_size
        dt = F.softplus(dt.float() + self.dt_bias.float())
        xh = x.view(num_tokens, heads, self.head_dim)
        # Heads h * G / H .. share group g: expand B / C to one row per head.
        per_group = heads // groups
        b = b.view(num_tokens, groups, 1, -1).expand(-1, -1, per_group, -1).reshape(
            num_tokens, heads, -1)
        c = c.view(num_tokens, groups, 1, -1).expand(-1, -1, per_group, -1).reshape(
            num_tokens, heads, -1)
        write_state = md is not None
        if md is None:                 # a dummy / profiling run: one stateless sequence
            md = single_sequence_metadata(num_tokens)
        y = mamba_chunk_scan_varlen(xh, dt, self.A.float(), b, c, self.ssm_state, md,
                                    write_state)
        y = y + xh * self.D.float()[:, None]
        return y.reshape(num_tokens, -1)
