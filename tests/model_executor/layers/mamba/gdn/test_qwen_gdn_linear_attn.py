"""`QwenGatedDeltaNetAttention`'s two checkpoint layouts give the same layer: Qwen3-Next's
per-key-head interleaved in_proj_qkvz / in_proj_ba (one shard each) and Qwen3.5's flat
[q | k | v | z] / [b | a] (separate shards), loaded through the layers' weight loaders from
the same underlying matrices; and a config whose value heads are not a multiple of its key
heads is refused."""

import pytest
import torch
from transformers import Qwen3NextConfig

from minivllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention)
from tests.model_executor.layers._helpers import layer_context

HK, HV, DK, DV, HIDDEN = 2, 4, 8, 6, 32


def _config(**overrides) -> Qwen3NextConfig:
    fields = dict(hidden_size=HIDDEN, linear_num_key_heads=HK, linear_num_value_heads=HV,
                  linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=4,
                  rms_norm_eps=1e-6)
    return Qwen3NextConfig(**{**fields, **overrides})


def _interleave(q, k, v, z, b, a):
    """Flat per-matrix rows -> Qwen3-Next's rows, grouped by key head: [q_g k_g v_g z_g] and
    [b_g a_g], where group g owns value heads g * r .. (g + 1) * r - 1."""
    r = HV // HK
    qkvz = torch.cat([q.view(HK, DK, -1), k.view(HK, DK, -1), v.view(HK, r * DV, -1),
                      z.view(HK, r * DV, -1)], dim=1).reshape(-1, HIDDEN)
    ba = torch.cat([b.view(HK, r, -1), a.view(HK, r, -1)], dim=1).reshape(-1, HIDDEN)
    return qkvz, ba


def _load(layer, qkvz_shards, ba_shards, shared):
    for shard_id, w in qkvz_shards:
        layer.in_proj_qkvz.weight.weight_loader(layer.in_proj_qkvz.weight, w, shard_id)
    for shard_id, w in ba_shards:
        layer.in_proj_ba.weight.weight_loader(layer.in_proj_ba.weight, w, shard_id)
    for name, w in shared.items():
        param = getattr(layer, name) if "." not in name else layer.get_parameter(name)
        param.weight_loader(param, w)


def test_interleaved_and_flat_layouts_agree():
    torch.manual_seed(0)
    key_dim, value_dim = HK * DK, HV * DV
    q, k = torch.randn(key_dim, HIDDEN), torch.randn(key_dim, HIDDEN)
    v, z = torch.randn(value_dim, HIDDEN), torch.randn(value_dim, HIDDEN)
    b, a = torch.randn(HV, HIDDEN), torch.randn(HV, HIDDEN)
    shared = {"conv1d.weight": torch.randn(2 * key_dim + value_dim, 1, 4),
              "A_log": torch.rand(HV).log(), "dt_bias": torch.randn(HV),
              "norm.weight": 1 + 0.2 * torch.randn(DV),
              "out_proj.weight": torch.randn(HIDDEN, value_dim) * 0.1}
    hidden = torch.randn(11, HIDDEN)
    with layer_context() as vllm_config:
        outs = []
        for interleaved in (True, False):
            layer = QwenGatedDeltaNetAttention(_config(), vllm_config,
                                               prefix=f"model.layers.{int(interleaved)}.x",
                                               gqa_interleaved_layout=interleaved)
            if interleaved:
                qkvz, ba = _interleave(q, k, v, z, b, a)
                _load(layer, [(None, qkvz)], [(None, ba)], shared)
            else:
                _load(layer, list(enumerate((q, k, v, z))), list(enumerate((b, a))), shared)
            outs.append(layer(hidden))                 # no forward context: a stateless run
    assert outs[0].abs().mean() > 1e-2          # a real output, not two zeros
    torch.testing.assert_close(outs[0], outs[1])


def test_value_heads_must_be_a_multiple_of_key_heads():
    with layer_context() as vllm_config, pytest.raises(ValueError, match="multiple"):
        QwenGatedDeltaNetAttention(_config(linear_num_value_heads=3), vllm_config,
                                   prefix="model.layers.0.linear_attn")
