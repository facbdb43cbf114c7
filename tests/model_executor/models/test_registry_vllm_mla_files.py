"""vLLM 0.33.0's own MLA model files on minivllm: deepseek_v2.py (DeepSeek-V2-Lite, V2, V3 shapes)
and glm4_moe_lite.py (GLM-4.7-Flash, built on vLLM's DeepSeek classes, which the port brings
along because minivllm's deepseek_v2 lacks vLLM's non-MLA `DeepseekV2Attention`), against
transformers; vLLM's V3 also at TP=2 over real worker processes.

The files come from vLLM's source distribution on PyPI (see `_vllm_files`).
"""

import pytest
from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

from tests._parallel_helpers import assert_parallel_matches_one_process
from tests.model_executor.models._family_helpers import (assert_matches_transformers,
                                                         build_model, write_tiny_checkpoint)
from tests.model_executor.models.test_deepseek_v2 import (TINY_MLA, VARIANTS,
                                                          _randomise_correction_bias)

# Real V3 / Kimi-K2 configs name their routing; vLLM's file creates the correction bias only
# when topk_method says noaux_tc.
_V3_ROUTING = dict(topk_method="noaux_tc", scoring_func="sigmoid")


def _deepseek_checkpoint(tmp_path, variant: str) -> str:
    config_cls, model_cls, extra = VARIANTS[variant]
    if variant == "v3":
        extra = {**extra, **_V3_ROUTING}
    path = write_tiny_checkpoint(tmp_path, config_cls, model_cls, **TINY_MLA, **extra)
    if variant == "v3":
        _randomise_correction_bias(path)
    return path


@pytest.mark.parametrize("variant", ["v2_lite", "v2_grouped", "v3"])
def test_vllm_deepseek_file_matches_transformers(variant, registered_vllm_class, tmp_path):
    arch = VARIANTS[variant][1].__name__
    cls = registered_vllm_class("deepseek_v2", arch, None)
    assert "._checked_deepseek_v2_" in cls.__module__      # vLLM's class, not minivllm's own
    path = _deepseek_checkpoint(tmp_path, variant)
    assert type(build_model(path)) is cls
    assert_matches_transformers(path)


def test_vllm_glm4_moe_lite_file_matches_transformers(registered_vllm_class, tmp_path):
    cls = registered_vllm_class("glm4_moe_lite", "Glm4MoeLiteForCausalLM", None)
    # vLLM's file reads first_k_dense_replace (transformers 5 writes mlp_layer_types beside it).
    path = write_tiny_checkpoint(tmp_path, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM,
                                 **TINY_MLA, q_lora_rank=24, n_group=2, topk_group=1,
                                 routed_scaling_factor=1.8, norm_topk_prob=True)
    _randomise_correction_bias(path)
    model = build_model(path)
    assert type(model) is cls
    # Its attention derives from vLLM's DeepseekV2MLAAttention (the ported sibling file).
    bases = type(model.model.layers[0].self_attn).__mro__
    assert any(b.__name__ == "DeepseekV2MLAAttention" and "._checked_deepseek_v2_" in b.__module__
               for b in bases)
    assert_matches_transformers(path)


def test_vllm_deepseek_file_at_tp2_equals_one_process(registered_vllm_class, tmp_path):
    registered_vllm_class("deepseek_v2", "DeepseekV3ForCausalLM", None)
    path = _deepseek_checkpoint(tmp_path, "v3")
    assert_parallel_matches_one_process(path, tensor_parallel_size=2)


def test_check_model_passes_on_vllm_deepseek_file_at_tp2(tmp_path):
    """`minivllm check-model --model-file <vLLM>/deepseek_v2.py:DeepseekV3ForCausalLM --hf -tp 2`:
    every section passes (the contract accepts the file's own EAGLE-3 aux-layer setter)."""
    from minivllm.entrypoints.check_model import CheckOptions, run_checks
    from tests.model_executor.models._vllm_files import vllm_models_dir

    path = _deepseek_checkpoint(tmp_path, "v3")
    spec = f"{vllm_models_dir() / 'deepseek_v2'}.py:DeepseekV3ForCausalLM"
    report = run_checks(CheckOptions(path, hf=True, model_file=spec, tensor_parallel_size=2))
    assert {s.status for s in report.sections.values()} == {"pass"}, report.to_text()
