"""`KimiGatedDeltaNetAttention`: Kimi Delta Attention (KDA), a Gated DeltaNet whose forget
gate is one rate per key channel instead of one per head (Kimi Linear's layer, vLLM's class).

    q, k, v, beta, f_a = in_proj_qkvgfab(h)         (+ g with a full-rank output gate)
    q, k, v = silu(conv1d([q | k | v]))             causal depthwise conv per sequence
    g = gate(f_b_proj(f_a) + dt_bias, A_log)        [T, heads, d]: -exp(A) softplus(.), or with
                                                    gate_lower_bound L: L sigmoid(exp(A) .)
    o = kda_rule(l2norm(q), l2norm(k), v, g, sigmoid(beta))           `ops/kda.py`
    out = o_proj(rms_norm(o) * w * sigmoid(g_b_proj(g_a_proj(h))))     per head of d channels

The conv and the per-sequence states are `gdn/base.py`'s (conv state [slots, K - 1, 3 h d],
recurrent state [slots, h, d, d] fp32 by default, vLLM's KDA rule). f_a (the forget gate's
low-rank input, head_dim wide) is replicated on every TP rank: a rank-0 shard of the merged
projection that every rank loads whole.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from minivllm.config import VllmConfig
from minivllm.distributed import get_tensor_model_parallel_rank
from minivllm.distributed.utils import divide
from minivllm.model_executor.layers.layernorm import RMSNormGated
from minivllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear, ReplicatedLinear,
                                                   RowParallelLinear)
from minivllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
from minivllm.model_executor.layers.mamba.mamba_utils import (MambaStateDtypeCalculator,
                                                              MambaStateShapeCalculator)
from minivllm.model_executor.layers.mamba.ops.kda import kda_gate, kda_varlen
from minivllm.model_executor.parameter import (LoaderFunction, default_weight_loader,
                                               set_weight_attrs, sharded_weight_loader)

# vLLM's bound on gate_lower_bound: a lower one lets exp(g) underflow in its kernels.
_KDA_GATE_LOGBOUND_MIN = -5.0


class _KimiGDNMergedColumnParallelLinear(MergedColumnParallelLinear):
    """A merged projection with one output (`replicated_shard_id`) whole on every TP rank:
    that shard reserves its full size per rank and always loads from rank 0's offset."""

    def __init__(self, input_size: int, output_sizes: list[int], replicated_shard_id: int,
                 tp_size: int, **kwargs: object) -> None:
        self.replicated_shard_id = replicated_shard_id
        sizes = list(output_sizes)
        sizes[replicated_shard_id] *= tp_size
        super().__init__(input_size, sizes, **kwargs)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | tuple[int, ...] | None = None) -> None:
        tp_rank = self.tp_rank
        if loaded_shard_id == self.replicated_shard_id:
            self.tp_rank = 0
        try:
            super().weight_loader(param, loaded_weight, loaded_shard_id)
        finally:
            self.tp_rank = tp_rank


class KimiGatedDeltaNetAttention(GatedDeltaNetAttention):
    """forward(hidden [T, hidden_size], positions [T]) -> [T, hidden_size] (o_proj all-reduced
    over TP). Sizes come from `config.linear_attn_config` (vLLM's Kimi Linear config)."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig,
                 prefix: str = "") -> None:
        super().__init__(config, vllm_config, prefix)
        kda_config = getattr(config, "linear_attn_config", None)
        if not kda_config:
            raise ValueError("KimiGatedDeltaNetAttention needs config.linear_attn_config "
                             "(head_dim, num_heads, short_conv_kernel_size)")
        self._read_sizes(kda_config)
        self.gate_lower_bound: float | None = kda_config.get("gate_lower_bound", None)
        if self.gate_lower_bound is not None and not (
                _KDA_GATE_LOGBOUND_MIN <= self.gate_lower_bound < 0):
            raise ValueError(f"gate_lower_bound must be in [{_KDA_GATE_LOGBOUND_MIN}, 0), got "
                             f"{self.gate_lower_bound}")
        self.use_safe_gate = self.gate_lower_bound is not None
        self._build_projections(prefix)
        self.dt_bias = nn.Parameter(torch.empty(self.local_projection_size, dtype=torch.float32),
                                    requires_grad=False)
        set_weight_attrs(self.dt_bias, {"weight_loader": sharded_weight_loader(0)})
        self.conv1d = ColumnParallelLinear(self.conv_size, 3 * self.projection_size, bias=False,
                                           params_dtype=torch.float32, prefix=f"{prefix}.conv1d")
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)    # [3 p/tp, 1, K]
        del self.conv1d.weight.weight_loader
        set_weight_attrs(self.conv1d.weight, {"weight_loader": _fused_conv1d_weight_loader(
            [self.projection_size] * 3, self.tp_size, self.tp_rank)})
        self.A_log = nn.Parameter(torch.empty(self.local_num_heads, dtype=torch.float32),
                                  requires_grad=False)
        set_weight_attrs(self.A_log, {"weight_loader": a_log_weight_loader(0)})
        self.o_norm = RMSNormGated(self.head_dim, eps=1e-5, norm_before_gate=True,
                                   activation="sigmoid")     # FLA's FusedRMSNormGated default eps
        self.o_proj = RowParallelLinear(self.projection_size, self.hidden_size, bias=False,
                                        input_is_parallel=True, quant_config=self.quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.register_states(vllm_config)

    def get_state_shape(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return MambaStateShapeCalculator.kda_state_shape(
            self.tp_size, self.num_heads, self.head_dim, conv_kernel_size=self.conv_size,
            num_spec=self.num_spec)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        return MambaStateDtypeCalculator.kda_state_dtype(
            self.model_config.dtype, self.cache_config.mamba_cache_dtype,
            self.cache_config.mamba_ssm_cache_dtype)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        projected = self.in_proj_qkvgfab(hidden_states)[0]
        lp, d, lh = self.local_projection_size, self.head_dim, self.local_num_heads
        if self.use_full_rank_gate:
            mixed_qkv, g_states, f_a, beta = projected.split([3 * lp, lp, d, lh], dim=-1)
        else:
            mixed_qkv, beta, f_a = projected.split([3 * lp, lh, d], dim=-1)
            g_states = self.g_b_proj(self.g_a_proj(hidden_states)[0])[0]
        g = kda_gate(self.f_b_proj(f_a)[0], self.A_log, d, g_bias=self.dt_bias,
                     lower_bound=self.gate_lower_bound)                # [T, h/tp, d] fp32
        core_attn_out = self.conv_and_delta_rule(mixed_qkv, g, torch.sigmoid(beta.float()),
                                                 rule=kda_varlen)      # [T, h/tp, d]
        core_attn_out = self.o_norm(core_attn_out, g_states.view(num_tokens, lh, d))
        return self.o_proj(core_attn_out.flatten(1))[0]

    def _read_sizes(self, kda_config: dict) -> None:
        """Heads and widths, also under the names `gdn/base.py`'s conv and rule read."""
        self.head_dim, self.num_heads = kda_config["head_dim"], kda_config["num_heads"]
        self.local_num_heads = divide(self.num_heads, self.tp_size)
        self.projection_size = self.head_dim * self.num_heads
        self.local_projection_size = divide(self.projection_size, self.tp_size)
        self.conv_size = self.conv_kernel_size = kda_config["short_conv_kernel_size"]
        self.use_full_rank_gate = kda_config.get("use_full_rank_gate", False)
        self.num_k_heads = self.num_v_heads = self.num_heads
        self.head_k_dim = self.head_v_dim = self.head_dim
        self.key_dim = self.value_dim = self.projection_size
        self.conv_dim = 3 * self.projection_size

    def _build_projections(self, prefix: str) -> None:
        """in_proj_qkvgfab in vLLM's shard order ([q, k, v, beta, f_a], or [q, k, v, g, f_a,
        beta] with a full-rank gate; f_a replicated), f_b_proj, and the low-rank output gate.
        (vLLM pads the full-rank projection to 16 rows per rank for its GEMMs; not here.)"""
        p, quant = self.projection_size, self.quant_config
        if self.use_full_rank_gate:
            sizes, replicated = [p] * 4 + [self.head_dim, self.num_heads], 4
        else:
            sizes, replicated = [p] * 3 + [self.num_heads, self.head_dim], 4
        self.in_proj_padding = 0
        self.in_proj_qkvgfab = _KimiGDNMergedColumnParallelLinear(
            self.hidden_size, sizes, replicated_shard_id=replicated, tp_size=self.tp_size,
            bias=False, quant_config=quant, prefix=f"{prefix}.in_proj_qkvgfab")
        self.f_b_proj = ColumnParallelLinear(self.head_dim, p, bias=False, quant_config=quant,
                                             prefix=f"{prefix}.f_b_proj")
        if not self.use_full_rank_gate:
            self.g_a_proj = ReplicatedLinear(self.hidden_size, self.head_dim, bias=False,
                                             quant_config=quant, prefix=f"{prefix}.g_a_proj")
            self.g_b_proj = ColumnParallelLinear(self.head_dim, p, bias=False,
                                                 quant_config=quant, prefix=f"{prefix}.g_b_proj")


def a_log_weight_loader(shard_axis: int) -> LoaderFunction:
    """A_log as stored now ([H]) or by older checkpoints ([1, 1, H, 1]): this rank's heads."""
    def loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.dim() == 4:
            if loaded_weight.shape[:2] != (1, 1) or loaded_weight.shape[-1] != 1:
                raise ValueError(f"A_log of shape {tuple(loaded_weight.shape)}: expected [H] "
                                 f"or [1, 1, H, 1]")
            loaded_weight = loaded_weight.view(loaded_weight.shape[2])
        size = param.shape[shard_axis]
        start = get_tensor_model_parallel_rank() * size
        default_weight_loader(param, loaded_weight.narrow(shard_axis, start, size))
    return loader


def _fused_conv1d_weight_loader(dims: list[int], tp_size: int,
                                tp_rank: int) -> LoaderFunction:
    """The fused [q | k | v] conv: checkpoint shard i ([dims[i], 1, K] or [dims[i], K]) gives
    this rank's slice of segment i."""
    local = [d // tp_size for d in dims]

    def loader(param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: int) -> None:
        if loaded_weight.dim() == 2:
            loaded_weight = loaded_weight.unsqueeze(1)
        size, offset = local[loaded_shard_id], sum(local[:loaded_shard_id])
        param.data[offset:offset + size].copy_(
            loaded_weight[tp_rank * size:(tp_rank + 1) * size])
    return loader
