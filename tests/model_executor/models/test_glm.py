"""GLM-4 v1 (GlmForCausalLM: two norms per block, GPT-J partial rotary) against transformers."""

from transformers import GlmConfig
from transformers import GlmForCausalLM as HFGlmForCausalLM

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean,
                                                         write_tiny_checkpoint)


def test_glm_matches_transformers(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "glm", GlmConfig, HFGlmForCausalLM, head_dim=32,
                                 partial_rotary_factor=0.5, attention_bias=True)
    assert_matches_transformers(path)
    assert_prefixes_clean(path, "GlmForCausalLM")
    assert_bad_names_reported(path, tmp_path / "broken",
                              drop=["model.layers.1.post_attention_layernorm.weight"])
    cls, _ = ModelRegistry.resolve_model_cls(["GlmForCausalLM"])
    assert cls.__module__ == "minivllm.model_executor.models.glm"
