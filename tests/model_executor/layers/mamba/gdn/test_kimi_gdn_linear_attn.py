"""`KimiGatedDeltaNetAttention` (vLLM's Kimi Delta Attention layer) against transformers'
`KimiLinearDeltaAttention` with the same weights, loaded through vLLM's shard layout (q, k, v,
beta, f_a into one merged projection; the fused conv by thirds; A_log in its old 4-D form):
two sequences prefilled in one step from zero states, then one decode step each from the
saved states, against transformers over the whole sequences."""

import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from minivllm.config import set_current_vllm_config
from minivllm.distributed import ensure_model_parallel_initialized
from minivllm.forward_context import set_forward_context
from minivllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import (
    KimiGatedDeltaNetAttention)
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata
from tests.model_executor.layers._helpers import make_vllm_config

HIDDEN, HEADS, HEAD_DIM = 32, 2, 8


def _config(**linear_attn: object) -> KimiLinearConfig:
    return KimiLinearConfig(hidden_size=HIDDEN, num_hidden_layers=2, rms_norm_eps=1e-5,
                            linear_attn_config={"head_dim": HEAD_DIM, "num_heads": HEADS,
                                                "short_conv_kernel_size": 4,
                                                "kda_layers": [1], "full_attn_layers": [2],
                                                **linear_attn})


def _load(layer: KimiGatedDeltaNetAttention, ref: KimiLinearDeltaAttention) -> None:
    """transformers' weights through vLLM's loaders, shard by shard."""
    merged = layer.in_proj_qkvgfab
    for shard, src in enumerate((ref.q_proj, ref.k_proj, ref.v_proj, ref.b_proj,
                                 ref.forget_gate.f_a_proj)):
        merged.weight_loader(merged.weight, src.weight.data, shard)
    for shard, part in enumerate(ref.conv1d.weight.data.chunk(3)):
        layer.conv1d.weight.weight_loader(layer.conv1d.weight, part, shard)
    layer.A_log.weight_loader(layer.A_log, ref.forget_gate.A_log.data)     # [1, 1, H, 1]
    for ours, theirs in ((layer.f_b_proj.weight, ref.forget_gate.f_b_proj.weight),
                         (layer.dt_bias, ref.forget_gate.dt_bias),
                         (layer.g_a_proj.weight, ref.g_a_proj.weight),
                         (layer.g_b_proj.weight, ref.g_b_proj.weight),
                         (layer.o_norm.weight, ref.o_norm.weight),
                         (layer.o_proj.weight, ref.o_proj.weight)):
        ours.data.copy_(theirs.data)


def _step(layer, vllm_config, hidden, qsl, slots, has_state):
    md = ShortConvAttentionMetadata(torch.tensor(qsl), torch.tensor(slots),
                                    torch.tensor(has_state), qsl[-1])
    with set_forward_context(None, vllm_config, state_metadata=md):
        return layer(hidden, torch.zeros(len(hidden), dtype=torch.long))


@torch.no_grad()
def test_prefill_and_decode_match_transformers():
    torch.manual_seed(0)
    config = _config()
    ref = KimiLinearDeltaAttention(config, layer_idx=0).eval()
    for param in ref.parameters():
        param.data.normal_(0, 0.3)
    ensure_model_parallel_initialized(1, 1)
    vllm_config = make_vllm_config()
    with set_current_vllm_config(vllm_config):
        layer = KimiGatedDeltaNetAttention(config, vllm_config,
                                           prefix="model.layers.0.self_attn")
    _load(layer, ref)
    assert layer.ssm_state.shape[1:] == (HEADS, HEAD_DIM, HEAD_DIM)
    lens, slots = (70, 9), [2, 0]
    seqs = [torch.randn(n + 1, HIDDEN) for n in lens]        # each: prompt + one decoded token
    prompt = torch.cat([s[:-1] for s in seqs])
    out = _step(layer, vllm_config, prompt, [0, lens[0], sum(lens)], slots, [False, False])
    decode = _step(layer, vllm_config, torch.stack([s[-1] for s in seqs]), [0, 1, 2], slots,
                   [True, True])
    for i, seq in enumerate(seqs):
        expected = ref(seq[None])[0]                          # [n + 1, hidden], no cache
        lo = sum(lens[:i])
        torch.testing.assert_close(out[lo:lo + lens[i]], expected[:-1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(decode[i], expected[-1], atol=1e-5, rtol=1e-4)


def test_gate_lower_bound_is_checked():
    ensure_model_parallel_initialized(1, 1)
    vllm_config = make_vllm_config()
    with set_current_vllm_config(vllm_config), pytest.raises(ValueError, match="lower_bound"):
        KimiGatedDeltaNetAttention(_config(gate_lower_bound=-7.0), vllm_config,
                                   prefix="model.layers.0.self_attn")
