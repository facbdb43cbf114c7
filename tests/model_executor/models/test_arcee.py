"""Arcee (Llama with a non-gated ReLU^2 MLP) against transformers."""

import pytest
from transformers import ArceeConfig, ArceeForCausalLM

from minivllm.model_executor.layers.activation import ReLUSquaredActivation
from tests.model_executor.models._family_helpers import (assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         write_tiny_checkpoint)

ARCH = "ArceeForCausalLM"


@pytest.fixture(scope="module")
def arcee_path(tmp_path_factory) -> str:
    # hidden_act "relu2" is the config default (AFM-4.5B's).
    return write_tiny_checkpoint(tmp_path_factory.mktemp("arcee"), ArceeConfig, ArceeForCausalLM)


def test_arcee_matches_transformers(arcee_path):
    assert_matches_transformers(arcee_path)
    assert_prefixes_clean(arcee_path, ARCH)
    mlp = build_model(arcee_path).model.layers[0].mlp
    assert isinstance(mlp.act_fn, ReLUSquaredActivation)
    assert mlp.up_proj.weight.shape == (128, 64) and not hasattr(mlp, "gate_up_proj")
