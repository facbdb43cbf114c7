"""EXAONE 4.0 (post-norm blocks, per-head QK-norm, sliding-window layers beside global NoPE
layers) against transformers."""

import pytest
from transformers import Exaone4Config, Exaone4ForCausalLM

from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         make_prompts, write_tiny_checkpoint)

ARCH = "Exaone4ForCausalLM"
# Four layers, pattern 2: sliding, global, sliding, global; the window (8) is shorter than
# every prompt, so a missing window or RoPE on a global layer would show.
HYBRID = dict(num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2)


@pytest.fixture(scope="module")
def exaone4_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("exaone4"), Exaone4Config,
                                 Exaone4ForCausalLM, **HYBRID)


def test_exaone4_hybrid_matches_transformers(exaone4_path):
    assert_matches_transformers(exaone4_path, prompts=make_prompts(1000, lens=(9, 33)),
                                num_tokens=16)


def test_exaone4_layers_window_and_rope(exaone4_path):
    model = build_model(exaone4_path)
    assert type(model).__module__ == "minivllm.model_executor.models.exaone4"
    layers = [layer.self_attn for layer in model.model.layers]
    assert [attn.attn.sliding_window for attn in layers] == [8, None, 8, None]
    assert [attn.rotary_emb is not None for attn in layers] == [True, False, True, False]
    assert layers[0].q_norm.weight.shape == (16,)          # per head (head_dim 16), not all heads


def test_exaone4_prefixes_and_bad_names(exaone4_path, tmp_path):
    assert_prefixes_clean(exaone4_path, ARCH)
    assert_bad_names_reported(exaone4_path, tmp_path / "broken",
                              drop=["model.layers.1.self_attn.q_norm.weight",
                                    "model.layers.3.post_feedforward_layernorm.weight"])


@pytest.mark.slow
def test_exaone4_without_window_rotates_every_layer(tmp_path):
    """No sliding window (as EXAONE-4.0-1.2B): every layer is global and every layer rotates.
    A window with no sliding layer leaves every layer position-free, as transformers does."""
    import json

    path = write_tiny_checkpoint(tmp_path / "global", Exaone4Config, Exaone4ForCausalLM,
                                 layer_types=["full_attention"] * 2)
    assert all(layer.self_attn.rotary_emb is None for layer in build_model(path).model.layers)
    # write_tiny_checkpoint drops None overrides: clear the window in the saved config.
    config_file = tmp_path / "global" / "config.json"
    config = json.loads(config_file.read_text())
    config["sliding_window"] = None
    config_file.write_text(json.dumps(config))
    assert all(layer.self_attn.rotary_emb is not None
               for layer in build_model(path).model.layers)
    assert_matches_transformers(path, prompts=make_prompts(1000, lens=(9, 40)), num_tokens=12)


@pytest.mark.slow
def test_exaone4_tp2_matches_transformers(exaone4_path, tmp_path):
    from tests.model_executor.models.test_ernie45_moe import registered_in_workers

    with registered_in_workers(tmp_path, ARCH, "exaone4"):
        assert_matches_transformers(exaone4_path, prompts=make_prompts(1000, lens=(9, 40)),
                                    num_tokens=12, tensor_parallel_size=2)
