"""SmolLM3 (RoPE on some layers, NoPE on others; GQA; tied embeddings) against transformers."""

from types import SimpleNamespace

import pytest
from transformers import SmolLM3Config, SmolLM3ForCausalLM

from minivllm.model_executor.models import smollm3
from tests.model_executor.models._family_helpers import (assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         make_prompts, write_tiny_checkpoint)

ARCH = "SmolLM3ForCausalLM"


@pytest.fixture(scope="module")
def smollm3_path(tmp_path_factory) -> str:
    # Interval 2 over 2 layers: layer 0 rotates, layer 1 is NoPE (transformers fills
    # no_rope_layers = [1, 0] from the interval). Tied LM head, GQA 4:2.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("smollm3"), SmolLM3Config,
                                 SmolLM3ForCausalLM, no_rope_layer_interval=2,
                                 tie_word_embeddings=True)


def test_smollm3_matches_transformers(smollm3_path):
    assert_matches_transformers(smollm3_path)
    assert_prefixes_clean(smollm3_path, ARCH)
    model = build_model(smollm3_path)
    assert [layer.self_attn.rotary_emb is not None for layer in model.model.layers] == [True, False]
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_smollm3_rope_on_every_layer_does_not_match(smollm3_path, monkeypatch):
    """The NoPE layer matters: plain Llama (RoPE everywhere) drifts from transformers."""
    monkeypatch.setattr(smollm3, "smollm3_uses_rope", lambda config, layer_idx: True)
    with pytest.raises(AssertionError, match="differ"):
        assert_matches_transformers(smollm3_path, prompts=make_prompts(1000, lens=(17,)),
                                    num_tokens=2)


def test_smollm3_rope_rule_follows_transformers():
    """Configs without `no_rope_layers` derive it from the interval as transformers does."""
    for interval in (1, 3, 4):
        hf = SmolLM3Config(num_hidden_layers=9, no_rope_layer_interval=interval)
        raw = SimpleNamespace(no_rope_layers=None, no_rope_layer_interval=interval)
        assert [smollm3.smollm3_uses_rope(raw, i) for i in range(9)] == \
            [bool(flag) for flag in hf.no_rope_layers]
    explicit = SimpleNamespace(no_rope_layers=[0, 1, 1], no_rope_layer_interval=4)
    assert [smollm3.smollm3_uses_rope(explicit, i) for i in range(3)] == [False, True, True]
