"""Qwen2 (minivllm's qwen2.py) against transformers' Qwen2ForCausalLM: fp32 greedy and logprobs,
prefixes, bad checkpoint names; the registry routes the architecture names to the file."""

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                          assert_matches_transformers,
                                                          build_model,
                                                          assert_prefixes_clean,
                                                          write_checkpoints)

CONFIGS = {
    "untied": dict(),
    # Layer 1 is a sliding layer (window 8 < the 60-token prompt); tied head; odd vocab.
    "tied_sliding": dict(tie_word_embeddings=True, vocab_size=997, use_sliding_window=True,
                         sliding_window=8, max_window_layers=1),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return write_checkpoints(tmp_path_factory, "qwen2", Qwen2Config, Qwen2ForCausalLM, CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_qwen2_matches_transformers(paths, name):
    assert_matches_transformers(paths[name], CONFIGS[name].get("vocab_size", 1000))


def test_qwen2_prefixes_and_bias(paths):
    assert_prefixes_clean(paths["untied"], "Qwen2ForCausalLM")
    attn = build_model(paths["untied"]).model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None


def test_qwen2_reports_every_bad_name(paths, tmp_path):
    biases = [f"model.layers.1.self_attn.{p}_proj.bias" for p in "qkv"]
    assert_bad_names_reported(paths["untied"], tmp_path / "broken",
                              drop=[*biases, "lm_head.weight"], missing=["model.layers.1.self_attn.qkv_proj.bias", "lm_head.weight"])


def test_qwen2_registered():
    for arch in ("Qwen2ForCausalLM", "Qwen2Model"):
        cls, _ = ModelRegistry.resolve_model_cls([arch])
        assert cls.__name__ == "Qwen2ForCausalLM"


def test_qwen2_refuses_what_it_cannot_honour(paths, tmp_path):
    import json
    import shutil

    folder = shutil.copytree(paths["untied"], tmp_path / "dca")
    config = json.loads((folder / "config.json").read_text())
    config["dual_chunk_attention_config"] = {"chunk_size": 64}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="dual_chunk_attention_config"):
        build_model(str(folder))
