"""models/text_only.py's pieces on their own: the text-config view, the prefix mapper, the tower
prefixes, the causal LM named by a nested text config, the one log line of skipped weights.
Whole vision-language checkpoints: test_text_only_vl_checkpoints.py."""

import logging

import pytest
import torch
from transformers import LlamaConfig, LlavaConfig, Qwen2Config

from minivllm.model_executor.models.text_only import (LANGUAGE_MODEL_PREFIXES,
                                                      TextOnlyConditionalGeneration,
                                                      causal_lm_of_text_config,
                                                      text_of_vl_mapper, text_only_view,
                                                      tower_prefixes)


def test_text_only_view_swaps_only_hf_config():
    from minivllm.config import ModelConfig, VllmConfig

    nested = LlavaConfig(text_config={"model_type": "qwen2", "hidden_size": 64})
    config = VllmConfig(model_config=ModelConfig(model="dummy", hf_config=nested,
                                                 dtype="float32"))
    view = text_only_view(config)
    assert view.model_config.hf_config is nested.text_config
    assert view.model_config.hf_config.model_type == "qwen2"
    # The engine's own config is untouched; every other part is shared, not copied.
    assert config.model_config.hf_config is nested
    assert view.cache_config is config.cache_config
    assert view.model_config.dtype == config.model_config.dtype


def test_text_of_vl_mapper_renames_drops_and_keeps():
    towers = tower_prefixes("vision_tower", "multi_modal_projector")
    assert towers == ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                      "multi_modal_projector.")
    mapper = text_of_vl_mapper(LANGUAGE_MODEL_PREFIXES, towers)
    names = {"model.language_model.layers.0.mlp.up_proj.weight":
             "model.layers.0.mlp.up_proj.weight",
             "language_model.model.norm.weight": "model.norm.weight",
             "language_model.lm_head.weight": "lm_head.weight",
             "lm_head.weight": "lm_head.weight",
             "vision_tower.encoder.layers.0.mlp.fc1.weight": None,
             "model.multi_modal_projector.linear_1.bias": None,
             # a tower nobody listed keeps its name: the loader reports it as unexpected
             "model.audio_tower.conv.weight": "model.audio_tower.conv.weight"}
    for name, expected in names.items():
        assert mapper.map_name(name) == expected, name


def test_causal_lm_of_text_config():
    assert causal_lm_of_text_config(LlamaConfig()).__name__ == "LlamaForCausalLM"
    assert causal_lm_of_text_config(Qwen2Config()).__name__ == "Qwen2ForCausalLM"
    named = LlamaConfig(architectures=["MistralForCausalLM"])    # its own list wins
    assert causal_lm_of_text_config(named).__name__ == "MistralForCausalLM"
    with pytest.raises(ValueError, match="no causal-LM class"):
        causal_lm_of_text_config(LlavaConfig().vision_config)
    with pytest.raises(ValueError, match="Supported architectures"):
        causal_lm_of_text_config(LlamaConfig(architectures=["NoSuchForCausalLM"]))


class _Recorder(torch.nn.Module):
    """A stand-in causal LM: records the config it was built from and the names it loads."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        self.built_from = vllm_config.model_config.hf_config
        self.norm = torch.nn.Parameter(torch.zeros(2))


class _TextOnly(TextOnlyConditionalGeneration, _Recorder):
    skipped_prefixes = tower_prefixes("vision_tower")
    hf_to_vllm_mapper = text_of_vl_mapper({"model.language_model.": ""}, skipped_prefixes)


def test_mixin_builds_from_text_config_and_logs_skipped_once(caplog):
    from minivllm.config import ModelConfig, VllmConfig

    config = VllmConfig(model_config=ModelConfig(
        model="dummy", hf_config=LlavaConfig(text_config={"model_type": "llama"})))
    model = _TextOnly(vllm_config=config)
    assert model.built_from.model_type == "llama"
    weights = [("model.language_model.norm", torch.ones(2)),
               ("vision_tower.a", torch.ones(3)), ("model.vision_tower.b", torch.ones(3))]
    with caplog.at_level(logging.INFO, logger="minivllm"):
        loaded = model.load_weights(iter(weights))
    assert loaded == {"norm"} and torch.equal(model.norm.data, torch.ones(2))
    logged = [r for r in caplog.records if "served text-only" in r.getMessage()]
    assert len(logged) == 1 and "skipped 2 vision / audio tower weights" in logged[0].getMessage()
    assert logged[0].name.endswith(_TextOnly.__module__)       # the family's logger
