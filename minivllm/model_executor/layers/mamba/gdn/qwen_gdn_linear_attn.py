"""`QwenGatedDeltaNetAttention`: Qwen3-Next's / Qwen3.5's Gated DeltaNet linear attention, a
recurrent-state layer.

    q, k, v, z = in_proj_qkvz(h);  b, a = in_proj_ba(h)     this TP rank's key / value heads
    q, k, v = silu(conv1d([q | k | v]))                      causal depthwise conv per sequence
    g = -exp(A_log) softplus(a + dt_bias);  beta = sigmoid(b)          [T, value heads]
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)             `ops/gated_delta_rule.py`
    out = out_proj(rms_norm(o) * w * silu(z))                per value head of dv channels

The conv, the rule and the two per-sequence states are `gdn/base.py`'s. Tensor parallelism
splits the key heads and their value heads.

Qwen3-Next's checkpoints (`gqa_interleaved_layout=True`) store in_proj_qkvz per key head,
[hk, (dk | dk | r dv | r dv)] with r = hv / hk, and in_proj_ba as [hk, (r | r)]: each is one
shard whose contiguous TP split gives every rank whole key-head groups. Qwen3.5's keep
[q | k | v | z] and [b | a] as separate shards.
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
from minivllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.parameter import set_weight_attrs, sharded_weight_loader

_GATES = {"silu": "silu", "swish": "silu", "sigmoid": "sigmoid"}


class QwenGatedDeltaNetAttention(GatedDeltaNetAttention):
    """hidden [T, hidden_size] -> [T, hidden_size] (out_proj all-reduced over TP unless
    reduce_results is False)."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig, prefix: str = "",
                 gqa_interleaved_layout: bool = False, reduce_results: bool = True) -> None:
        super().__init__(config, vllm_config, prefix)
        self.read_head_sizes(config)
        self.gqa_interleaved_layout = gqa_interleaved_layout
        quant = self.quant_config
        self.conv1d = ColumnParallelLinear(self.conv_kernel_size, self.conv_dim, bias=False,
                                           prefix=f"{prefix}.conv1d")
        self.conv1d.weight.data = self.conv1d.weight.data.unsqueeze(1)    # [conv/tp, 1, K]
        # The conv's channels are [q | k | v]: a rank takes its share of each segment.
        del self.conv1d.weight.weight_loader
        set_weight_attrs(self.conv1d.weight, {"weight_loader": mamba_v2_sharded_weight_loader(
            [(self.key_dim, False), (self.key_dim, False), (self.value_dim, False)],
            self.tp_size, self.tp_rank)})
        self.in_proj_qkvz = self.create_qkvz_proj(self.hidden_size, self.key_dim,
                                                  self.value_dim, quant, f"{prefix}.in_proj_qkvz")
        self.in_proj_ba = self.create_ba_proj(self.hidden_size, self.num_v_heads, quant,
                                              f"{prefix}.in_proj_ba")
        local_v_heads = divide(self.num_v_heads, self.tp_size)
        self.dt_bias = nn.Parameter(torch.ones(local_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(local_v_heads, dtype=torch.float32),
                                  requires_grad=False)
        set_weight_attrs(self.A_log, {"weight_loader": sharded_weight_loader(0)})
        set_weight_attrs(self.dt_bias, {"weight_loader": sharded_weight_loader(0)})
        gate = getattr(config, "output_gate_type", "silu")
        if gate not in _GATES:
            raise ValueError(f"output_gate_type must be one of {sorted(_GATES)}, got {gate!r}")
        self.norm = RMSNormGated(self.head_v_dim, eps=self.layer_norm_epsilon, group_size=None,
                                 norm_before_gate=True, activation=_GATES[gate])
        self.out_proj = RowParallelLinear(self.value_dim, self.hidden_size, bias=False,
                                          input_is_parallel=True, reduce_results=reduce_results,
                                          quant_config=quant, prefix=f"{prefix}.out_proj")
        self.register_states(vllm_config)

    def create_qkvz_proj(self, hidden_size: int, key_dim: int, value_dim: int,
                         quant_config: QuantizationConfig | None,
                         prefix: str) -> MergedColumnParallelLinear:
        """Interleaved checkpoints: one shard (the per-key-head layout survives a contiguous
        split); otherwise q, k, v, z as four shards."""
        sizes = ([2 * key_dim + 2 * value_dim] if self.gqa_interleaved_layout
                 else [key_dim, key_dim, value_dim, value_dim])
        return MergedColumnParallelLinear(hidden_size, sizes, bias=False,
                                          quant_config=quant_config, prefix=prefix)

    def create_ba_proj(self, hidden_size: int, num_v_heads: int,
                       quant_config: QuantizationConfig | None,
                       prefix: str) -> MergedColumnParallelLinear:
        sizes = [2 * num_v_heads] if self.gqa_interleaved_layout else [num_v_heads] * 2
        return MergedColumnParallelLinear(hidden_size, sizes, bias=False,
                                          quant_config=quant_config, prefix=prefix)

    def fix_query_key_value_ordering(self, mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor
                                     ) -> tuple[torch.Tensor, ...]:
        """The interleaved projections -> q / k [T, hk, dk], v / z [T, hv, dv], b / a [T, hv]
        (this rank's heads)."""
        num_tokens, groups = mixed_qkvz.shape[0], self.num_k_heads // self.tp_size
        rep = self.num_v_heads // self.num_k_heads
        qkvz = mixed_qkvz.view(num_tokens, groups, -1)            # [T, hk, 2dk + 2 r dv]
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, rep * self.head_v_dim,
                                 rep * self.head_v_dim], dim=-1)
        b, a = mixed_ba.view(num_tokens, groups, 2 * rep).split([rep, rep], dim=-1)
        v = v.reshape(num_tokens, -1, self.head_v_dim)           # value heads in group order
        z = z.reshape(num_tokens, -1, self.head_v_dim)
        return q, k, v, z, b.reshape(num_tokens, -1), a.reshape(num_tokens, -1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mixed_qkv, z, b, a = self._project(hidden_states)
        g, beta = gdn_decay(self.A_log, a, self.dt_bias), torch.sigmoid(b.float())
        core_attn_out = self.conv_and_delta_rule(mixed_qkv, g, beta)        # [T, hv, dv]
        return self._output_projection(core_attn_out, z)

    def _project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """-> mixed [q | k | v] [T, conv/tp] (the conv's channel order), z [T, hv, dv],
        b / a [T, hv]."""
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        mixed_ba, _ = self.in_proj_ba(hidden_states)
        num_tokens = hidden_states.shape[0]
        if self.gqa_interleaved_layout:
            q, k, v, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, mixed_ba)
            mixed_qkv = torch.cat([x.reshape(num_tokens, -1) for x in (q, k, v)], dim=-1)
            return mixed_qkv, z, b, a
        qkv_size = self.conv_dim // self.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
        b, a = mixed_ba.chunk(2, dim=-1)
        return mixed_qkv, z.reshape(num_tokens, -1, self.head_v_dim), b, a

    def _output_projection(self, core_attn_out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated norm per value head, then out_proj: [T, hv, dv] -> [T, hidden]."""
        core_attn_out = self.norm(core_attn_out, z)
        output, _ = self.out_proj(core_attn_out.flatten(-2))
        return output
