"""`OlmoHybridGatedDeltaNetAttention`: OLMo hybrid's Gated DeltaNet linear attention.

    q, k, v, g = in_proj_qkvg(h);  b = b_proj(h);  a = a_proj(h)     this TP rank's heads
    o = gated_delta_rule(conv([q | k | v]), decay(a), beta)          `gdn/base.py`
    beta = sigmoid(b), times 2 with linear_allow_neg_eigval (the state may flip sign)
    out = o_proj(rms_norm(o) * w * silu(g))                          per value head, eps 1e-5

Checkpoints keep q_conv1d / k_conv1d / v_conv1d apart; vLLM's file maps them onto one
fused conv1d as shards 0, 1, 2 (a rank takes its slice of each).
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from minivllm.config import VllmConfig
from minivllm.distributed.utils import divide
from minivllm.model_executor.layers.layernorm import RMSNormGated
from minivllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear, RowParallelLinear)
from minivllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention, gdn_decay
from minivllm.model_executor.parameter import LoaderFunction, set_weight_attrs, \
    sharded_weight_loader


class OlmoHybridGatedDeltaNetAttention(GatedDeltaNetAttention):
    """forward(hidden [T, hidden_size], output [T, hidden_size]) writes into output (vLLM's
    calling form; o_proj all-reduced over TP)."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig,
                 prefix: str = "") -> None:
        super().__init__(config, vllm_config, prefix=prefix)
        if not getattr(config, "linear_use_gate", True):
            raise ValueError("OlmoHybridGatedDeltaNetAttention needs linear_use_gate=True")
        self.read_head_sizes(config)
        self.allow_neg_eigval = getattr(config, "linear_allow_neg_eigval", False)
        quant = self.quant_config
        self.in_proj_qkvg = MergedColumnParallelLinear(
            self.hidden_size, [self.key_dim, self.key_dim, self.value_dim, self.value_dim],
            bias=False, quant_config=quant, prefix=f"{prefix}.in_proj_qkvg")
        # Two matmuls, not one fused [b | a]: vLLM keeps them apart for their rounding.
        self.b_proj = ColumnParallelLinear(self.hidden_size, self.num_v_heads, bias=False,
                                           quant_config=quant, prefix=f"{prefix}.b_proj")
        self.a_proj = ColumnParallelLinear(self.hidden_size, self.num_v_heads, bias=False,
                                           quant_config=quant, prefix=f"{prefix}.a_proj")
        self.conv1d = ColumnParallelLinear(self.conv_kernel_size, self.conv_dim, bias=False,
                                           prefix=f"{prefix}.conv1d")
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)    # [conv/tp, 1, K]
        del self.conv1d.weight.weight_loader
        set_weight_attrs(self.conv1d.weight, {"weight_loader": _fused_conv1d_weight_loader(
            [self.key_dim, self.key_dim, self.value_dim], self.tp_size, self.tp_rank)})
        local_v_heads = divide(self.num_v_heads, self.tp_size)
        self.dt_bias = nn.Parameter(torch.ones(local_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(local_v_heads), requires_grad=False)
        set_weight_attrs(self.A_log, {"weight_loader": sharded_weight_loader(0)})
        set_weight_attrs(self.dt_bias, {"weight_loader": sharded_weight_loader(0)})
        # eps 1e-5 whatever the config says: FLA's FusedRMSNormGated, as trained.
        self.o_norm = RMSNormGated(self.head_v_dim, eps=1e-5, group_size=None,
                                   norm_before_gate=True, activation="silu")
        self.o_proj = RowParallelLinear(self.value_dim, self.hidden_size, bias=False,
                                        input_is_parallel=True, quant_config=quant,
                                        prefix=f"{prefix}.o_proj")
        self.register_states(vllm_config)

    def forward(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        num_tokens, tp = hidden_states.shape[0], self.tp_size
        qkvg, _ = self.in_proj_qkvg(hidden_states)
        mixed_qkv, gate = qkvg.split([self.conv_dim // tp, self.value_dim // tp], dim=-1)
        b, _ = self.b_proj(hidden_states)
        a, _ = self.a_proj(hidden_states)
        beta = torch.sigmoid(b.float())
        if self.allow_neg_eigval:
            beta = beta * 2.0
        core_attn_out = self.conv_and_delta_rule(mixed_qkv, gdn_decay(self.A_log, a,
                                                                      self.dt_bias), beta)
        normed = self.o_norm(core_attn_out, gate.view(num_tokens, -1, self.head_v_dim))
        output[:num_tokens], _ = self.o_proj(normed.flatten(-2))


def _fused_conv1d_weight_loader(dims: list[int], tp_size: int,
                                tp_rank: int) -> LoaderFunction:
    """A loader of the fused [q | k | v] conv: checkpoint shard i ([dims[i], 1, K] or
    [dims[i], K]) gives this rank's slice of segment i; no shard id: the whole fused tensor.
    The id comes as an argument (vLLM's form) or on the tensor (`WeightsMapper`'s)."""
    local = [d // tp_size for d in dims]

    def loader(param: torch.Tensor, loaded_weight: torch.Tensor,
               loaded_shard_id: int | None = None) -> None:
        if loaded_shard_id is None:
            loaded_shard_id = getattr(loaded_weight, "shard_id", None)
        if loaded_weight.dim() == 2:
            loaded_weight = loaded_weight.unsqueeze(1)
        if loaded_shard_id is None:
            for shard, part in enumerate(loaded_weight.split(dims, dim=0)):
                loader(param, part, shard)
            return
        if loaded_weight.shape[0] != dims[loaded_shard_id]:
            raise ValueError(f"conv1d shard {loaded_shard_id} has {loaded_weight.shape[0]} "
                             f"channels, expected {dims[loaded_shard_id]}")
        size, offset = local[loaded_shard_id], sum(local[:loaded_shard_id])
        param.data[offset:offset + size].copy_(
            loaded_weight[tp_rank * size:(tp_rank + 1) * size])
    return loader
