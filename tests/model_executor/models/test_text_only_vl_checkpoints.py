"""Vision-language checkpoints served text-only (models/text_only.py and the families' classes):
tiny checkpoints written by transformers' own ConditionalGeneration classes (tiny towers, so the
real tower weight names are there) run as their language model with transformers' tokens and
logprobs on text prompts; towers skipped in one log line; an unknown tower reported; the
in-memory v5 layout (`model.language_model.*`) loads the same weights as the saved one."""

import logging
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from minivllm import LLM
from tests.model_executor.models._family_helpers import (TINY_DENSE, assert_bad_names_reported,
                                                         build_model, hf_greedy, make_prompts,
                                                         minivllm_greedy)

PROMPTS = make_prompts(TINY_DENSE["vocab_size"], (5, 19))
NUM_TOKENS = 8

_VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, image_size=16, patch_size=4)
_GEMMA3_TEXT = dict(head_dim=32, query_pre_attn_scalar=16, sliding_window=8, rms_norm_eps=1e-6,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 10.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 10000.0}},
                    tie_word_embeddings=True)
# Sliding / full layers with their own head sizes, V = K, KV sharing, per-layer inputs.
_GEMMA4_TEXT = dict(num_hidden_layers=4, sliding_window=8, head_dim=16, global_head_dim=32,
                    num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    hidden_size_per_layer_input=8, vocab_size_per_layer_input=1000,
                    final_logit_softcapping=5.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
_GEMMA4_TOWERS = dict(
    vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=4,
                       position_embedding_size=64),
    audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      subsampling_conv_channels=[8, 4], output_proj_dims=32))
# Ministral 3: YaRN and Llama-4 q scaling stepping every 16 positions.
_MINISTRAL3_TEXT = dict(model_type="ministral3", head_dim=16, sliding_window=None,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0,
                                         "original_max_position_embeddings": 16,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1})

# family -> (transformers class, text config, tower configs, minivllm causal LM underneath)
FAMILIES = {
    "gemma3": ("Gemma3ForConditionalGeneration", _GEMMA3_TEXT,
               dict(vision_config=_VISION, mm_tokens_per_image=4), "Gemma3ForCausalLM"),
    "gemma4": ("Gemma4ForConditionalGeneration", _GEMMA4_TEXT, _GEMMA4_TOWERS,
               "Gemma4ForCausalLM"),
    "mistral3": ("Mistral3ForConditionalGeneration", _MINISTRAL3_TEXT,
                 dict(vision_config=dict(_VISION, head_dim=16)), "MistralForCausalLM"),
    "llava": ("LlavaForConditionalGeneration", dict(model_type="llama"),
              dict(vision_config=dict(_VISION, projection_dim=32)), "LlamaForCausalLM"),
    "llava_qwen2": ("LlavaForConditionalGeneration", dict(model_type="qwen2"),
                    dict(vision_config=dict(_VISION, projection_dim=32)), "Qwen2ForCausalLM"),
    "llava_mistral": ("LlavaForConditionalGeneration",
                      dict(model_type="mistral", head_dim=16, sliding_window=8),
                      dict(vision_config=dict(_VISION, projection_dim=32)), "MistralForCausalLM"),
    "idefics3": ("Idefics3ForConditionalGeneration", dict(model_type="llama"),
                 dict(vision_config=_VISION, scale_factor=2), "LlamaForCausalLM"),
    "smolvlm": ("SmolVLMForConditionalGeneration", dict(model_type="llama"),
                dict(vision_config=_VISION, scale_factor=2), "LlamaForCausalLM"),
}
# Tower / projector prefixes, in the layouts transformers saves (what must be skipped).
_TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                   "model.embed_audio.", "vision_tower.", "multi_modal_projector.",
                   "model.vision_model.", "model.connector.")


def _write_vl_checkpoint(folder, family: str) -> str:
    """A random fp32 checkpoint saved by transformers' VL class (norms perturbed off 1 / 0)."""
    cls_name, text, towers, _ = FAMILIES[family]
    torch.manual_seed(0)
    text = {**TINY_DENSE, "tie_word_embeddings": False, **text}
    config_cls = transformers.AutoConfig.for_model
    model_type = {"gemma3": "gemma3", "gemma4": "gemma4", "mistral3": "mistral3",
                  "idefics3": "idefics3", "smolvlm": "smolvlm"}.get(family, "llava")
    config = config_cls(model_type, text_config=text, **towers,
                        tie_word_embeddings=text["tie_word_embeddings"])
    model = getattr(transformers, cls_name)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "layer_scalar" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def vl_paths(tmp_path_factory) -> dict[str, str]:
    """One checkpoint per family, written on first use."""
    written: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in written:
            written[family] = _write_vl_checkpoint(tmp_path_factory.mktemp(family), family)
        return written[family]
    return get


def _assert_matches_vl_class(path: str, family: str, budget: int = 8) -> None:
    """fp32 greedy tokens equal to the transformers VL class's on text prompts, logprobs
    (prompt and generated) within 1e-4; prompts chunked by `budget`."""
    ref = hf_greedy(path, PROMPTS, NUM_TOKENS, model_cls=getattr(transformers, FAMILIES[family][0]))
    llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=budget)
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(
            zip(minivllm_greedy(llm, PROMPTS, NUM_TOKENS), ref)):
        assert tokens == ref_tokens, f"{family} prompt {i}: tokens differ from transformers"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= 1e-4, f"{family} prompt {i}: logprobs differ by {diff:.3g}"


# ~5 s each (transformers' reference is most of it): Llava's own layout and dispatch run by
# default on Qwen2 (Llama numerics: idefics3); the builds below check every family's wiring.
@pytest.mark.parametrize("family", [
    "gemma3", "gemma4", "mistral3", "llava_qwen2", "idefics3",
    *(pytest.param(f, marks=pytest.mark.slow) for f in ("llava", "llava_mistral", "smolvlm"))])
def test_vl_checkpoint_matches_transformers_vl_class(vl_paths, family):
    _assert_matches_vl_class(vl_paths(family), family)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vl_checkpoint_builds_its_language_model_only(vl_paths, family, caplog):
    """The registered class (vLLM's name) on the right causal LM, built from the text config,
    no tower parameters; one log line counts the skipped tower weights."""
    path = vl_paths(family)
    names = load_file(os.path.join(path, "model.safetensors")).keys()
    num_towers = sum(name.startswith(_TOWER_PREFIXES) for name in names)
    assert num_towers > 0
    with caplog.at_level(logging.INFO, logger="minivllm"):
        model = build_model(path)
    cls_name, text, _, causal_lm = FAMILIES[family]
    assert type(model).__name__ == cls_name
    assert causal_lm in [base.__name__ for base in type(model).__mro__]
    assert model.config.model_type == text.get("model_type", f"{family}_text")
    assert not any(n.startswith(("vision", "audio", "embed_vision", "multi_modal", "connector"),
                                len("model.")) for n, _ in model.named_parameters())
    logged = [r.getMessage() for r in caplog.records if "served text-only" in r.getMessage()]
    assert len(logged) == 1 and f"skipped {num_towers} vision / audio tower weights" in logged[0]


def test_unknown_tower_and_missing_weights_reported_together(vl_paths, tmp_path):
    """A tower prefix no class lists is an unexpected weight (under its checkpoint name), named
    with a missing language-model weight in one error; the known towers are not named."""
    path = vl_paths("gemma3")
    assert_bad_names_reported(path, tmp_path / "broken",
                              drop=["language_model.model.layers.1.mlp.down_proj.weight"],
                              extra=("sound_tower.proj.weight", "image_newline"),
                              missing=["model.layers.1.mlp.down_proj.weight"])
    with pytest.raises(ValueError) as err:
        build_model(str(tmp_path / "broken"))
    unexpected = str(err.value).split("Unexpected checkpoint weights", 1)[1]
    assert "(2 in all)" in unexpected and "vision_tower" not in unexpected


def test_in_memory_v5_layout_loads_the_same_weights(vl_paths, tmp_path):
    """transformers v5 saves the Hub's layout (`language_model.model.*`, top-level towers) but
    holds `model.language_model.*` in memory, and some tools save that: the same parameters
    load from it."""
    path = vl_paths("llava")
    folder = tmp_path / "v5_layout"
    shutil.copytree(path, folder)
    file = folder / "model.safetensors"
    renames = {"language_model.model.": "model.language_model.",
               "language_model.lm_head.": "lm_head.", "vision_tower.": "model.vision_tower.",
               "multi_modal_projector.": "model.multi_modal_projector."}
    state = {}
    for name, tensor in load_file(file).items():
        old = next(o for o in renames if name.startswith(o))
        state[renames[old] + name[len(old):]] = tensor
    save_file(state, file, metadata={"format": "pt"})
    ours, ref = build_model(str(folder)), build_model(path)
    pairs = list(zip(ours.named_parameters(), ref.named_parameters(), strict=True))
    assert all(n == rn and torch.equal(p, rp) for (n, p), (rn, rp) in pairs)
