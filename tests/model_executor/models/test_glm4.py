"""GLM-4 (sandwich norms, GPT-J-style partial rotary, fused gate_up) against transformers."""

from transformers import Glm4Config, Glm4ForCausalLM

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, build_model,
                                                         write_tiny_checkpoint)


def test_glm4_matches_transformers(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "glm4", Glm4Config, Glm4ForCausalLM, head_dim=32,
                                 partial_rotary_factor=0.5, attention_bias=True)
    assert_matches_transformers(path)
    assert_prefixes_clean(path, "Glm4ForCausalLM")
    rope = build_model(path).model.layers[0].self_attn.rotary_emb
    assert (rope.rotary_dim, rope.head_size, rope.is_neox_style) == (16, 32, False)
    assert_bad_names_reported(path, tmp_path / "broken",
                              drop=["model.layers.0.post_mlp_layernorm.weight",
                                    "model.layers.1.mlp.gate_up_proj.weight"])


def test_glm4_is_registered():
    cls, _ = ModelRegistry.resolve_model_cls(["Glm4ForCausalLM"])
    assert cls.__module__ == "minivllm.model_executor.models.glm4"
