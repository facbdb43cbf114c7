"""weight_utils: vLLM's loader helpers at TP = 1 (TP = 2 in tests/distributed) and the KV-scale
name remapping."""

import logging

import torch

from minivllm.distributed import ensure_model_parallel_initialized
from minivllm.model_executor.model_loader.weight_utils import (composed_weight_loader,
                                                               default_weight_loader,
                                                               maybe_remap_kv_scale_name,
                                                               row_parallel_weight_loader,
                                                               sharded_weight_loader)
from minivllm.model_executor.utils import set_weight_attrs


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape), requires_grad=False)


def test_loaders_at_tp1():
    ensure_model_parallel_initialized(1, 1)
    full = torch.randn(3, 4)
    for loader in (sharded_weight_loader(0), sharded_weight_loader(1), row_parallel_weight_loader):
        param = _param(3, 4)
        loader(param, full)
        assert torch.equal(param.data, full)
    param = _param(3, 4)
    set_weight_attrs(param, {"input_dim": 1})
    row_parallel_weight_loader(param, full)
    assert torch.equal(param.data, full)
    # composed: load, then transform in place (Mamba's A = -exp(A_log))
    param = _param(3, 4)
    composed_weight_loader(default_weight_loader, lambda p: -torch.exp(p))(param, full)
    torch.testing.assert_close(param.data, -torch.exp(full))


def test_maybe_remap_kv_scale_name(caplog):
    params = dict.fromkeys(["model.layers.0.self_attn.attn.k_scale",
                            "model.layers.0.self_attn.attn.v_scale"], 0)
    expect = {
        "model.layers.0.self_attn.kv_scale": "model.layers.0.self_attn.attn.k_scale",
        "model.layers.0.self_attn.k_proj.k_scale": "model.layers.0.self_attn.attn.k_scale",
        "model.layers.0.self_attn.qkv_proj.v_scale": "model.layers.0.self_attn.attn.v_scale",
        "model.layers.0.self_attn.k_scale": "model.layers.0.self_attn.attn.k_scale",
        "model.layers.0.self_attn.attn.v_scale": "model.layers.0.self_attn.attn.v_scale",
        "model.layers.0.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
    }
    for name, remapped in expect.items():
        assert maybe_remap_kv_scale_name(name, params) == remapped, name
    with caplog.at_level(logging.WARNING):
        assert maybe_remap_kv_scale_name("model.layers.3.self_attn.v_proj.v_scale", params) is None
    assert "model.layers.3.self_attn.attn.v_scale" in caplog.text
