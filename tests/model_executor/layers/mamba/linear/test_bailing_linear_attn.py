"""`bailing_linear_attn.py`'s helpers: the RoPE parameters gathered from a config's fields, and
the gated group norm (per-group RMS, sigmoid gate) with its TP-sharded weight loader. The
layer itself runs against an fp64 reference in
tests/model_executor/models/test_registry_vllm_bailing_linear_file.py."""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from minivllm.model_executor.layers.mamba.linear import bailing_linear_attn as bla
from tests.model_executor.layers._helpers import layer_context


@pytest.fixture(autouse=True)
def _config():
    with layer_context() as config:
        yield config


def test_rope_parameters_from_top_level_fields_and_legacy_scaling():
    config = SimpleNamespace(rope_parameters=None, rope_theta=600000.0,
                             partial_rotary_factor=0.5,
                             rope_scaling={"type": "linear", "factor": 2.0})
    assert bla._build_rope_parameters(config) == {
        "rope_theta": 600000.0, "partial_rotary_factor": 0.5, "rope_type": "linear",
        "factor": 2.0}
    # rope_parameters win over the top-level fields; a config naming nothing gives None.
    config = SimpleNamespace(rope_parameters={"rope_theta": 5.0}, rope_theta=7.0)
    assert bla._build_rope_parameters(config) == {"rope_theta": 5.0}
    assert bla._build_rope_parameters(SimpleNamespace()) is None


def test_group_norm_gate_normalises_each_group():
    norm = bla.BailingGroupRMSNormGate(8, eps=1e-6, group_size=4)
    norm.weight.data = torch.arange(1.0, 9.0)
    x, gate = torch.randn(3, 8), torch.randn(3, 8)
    groups = x.view(3, 2, 4)
    ref = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-6)).view(3, 8)
    ref = ref * norm.weight * torch.sigmoid(gate)
    assert torch.allclose(norm(x, gate), ref, atol=1e-6)


def test_group_norm_weight_loader_takes_the_ranks_share():
    norm = bla.BailingGroupRMSNormGate(4, group_size=4)
    with mock.patch.object(bla, "get_tensor_model_parallel_world_size", return_value=2), \
            mock.patch.object(bla, "get_tensor_model_parallel_rank", return_value=1):
        norm.weight.weight_loader(norm.weight, torch.arange(8.0))
    assert norm.weight.tolist() == [4.0, 5.0, 6.0, 7.0]
