"""minivllm's own Gemma 3n (text) against transformers: four AltUp streams, Laurel blocks,
per-layer input embeddings (a per-layer vocabulary smaller than the model's, so some tokens
fall back to row 0), gaussian top-k activation sparsity on the first two layers, per-layer MLP
widths, sliding (window 16 < prompts) and full layers, q / k / v norms, KV-sharing last layers
and final logit soft-capping. Whole prompts and chunks of 8; the released checkpoints' class
(Gemma3nForConditionalGeneration) served text-only; prefixes, bad names, a bad activation."""

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma3nConfig, Gemma3nForCausalLM, Gemma3nTextConfig

from minivllm import LLM
from minivllm.model_executor.models.registry import ModelRegistry
from tests._parallel_helpers import assert_parallel_matches_one_process
from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_prefixes_clean, build_model,
                                                         hf_greedy, make_prompts,
                                                         minivllm_greedy, write_tiny_checkpoint)

# 5 layers: 0-2 own their caches; 3 (sliding) reads layer 1's, 4 (full) reads layer 2's.
TINY_GEMMA3N = dict(
    num_hidden_layers=5, head_dim=16, sliding_window=16, num_kv_shared_layers=2,
    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "full_attention"],
    intermediate_size=[128, 96, 128, 64, 128],
    activation_sparsity_pattern=[0.95, 0.5, 0.0, 0.0, 0.0], hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=500, altup_num_inputs=4, laurel_rank=8,
    hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0,
    tie_word_embeddings=True)
SHARED_LAYERS = range(3, 5)
PROMPTS = make_prompts(1000, (5, 17, 40))    # past the window and the chunks of 8
NUM_TOKENS = 16


def write_gemma3n_checkpoint(folder, **overrides) -> str:
    """The tiny text checkpoint, with AltUp's `correct_output_scale` moved off its initial 0
    (at 0 the per-layer-input branch adds nothing and a wrong one would not show) and the
    k / v tensors original checkpoints still ship for the KV-sharing layers (transformers
    ignores them; minivllm must drop them)."""
    path = write_tiny_checkpoint(folder, Gemma3nTextConfig, Gemma3nForCausalLM,
                                 **{**TINY_GEMMA3N, **overrides})
    file = os.path.join(path, "model.safetensors")
    state, gen = load_file(file), torch.Generator().manual_seed(3)
    for name, tensor in state.items():
        if name.endswith("correct_output_scale"):
            state[name] = 0.5 + torch.rand(tensor.shape, generator=gen)
    for i in SHARED_LAYERS if "num_kv_shared_layers" not in overrides else ():
        for name, shape in (("k_proj.weight", (32, 64)), ("v_proj.weight", (32, 64)),
                            ("k_norm.weight", (16,))):
            state[f"model.layers.{i}.self_attn.{name}"] = torch.randn(shape, generator=gen)
    save_file(state, file, metadata={"format": "pt"})
    return path


def assert_same_run(ours: list, reference: list, atol: float = 1e-4) -> None:
    """Greedy tokens identical, every prompt / sampled token's logprob within `atol`."""
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(zip(ours, reference)):
        assert tokens == ref_tokens, f"prompt {i}: tokens differ from transformers"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= atol, f"prompt {i}: logprobs differ by {diff:.3g} (> {atol})"


def run_greedy(path: str, **llm_kwargs) -> list:
    llm = LLM(model=path, **{"dtype": "float32", "block_size": 4, **llm_kwargs})
    return minivllm_greedy(llm, PROMPTS, NUM_TOKENS)


@pytest.fixture(scope="module")
def gemma3n_path(tmp_path_factory) -> str:
    return write_gemma3n_checkpoint(tmp_path_factory.mktemp("gemma3n"))


@pytest.fixture(scope="module")
def gemma3n(gemma3n_path) -> tuple[str, list]:
    """(checkpoint, transformers' greedy run on it), built once."""
    return gemma3n_path, hf_greedy(gemma3n_path, PROMPTS, NUM_TOKENS)


@pytest.mark.parametrize("budget", [512, 8])
def test_gemma3n_matches_transformers(gemma3n, budget):
    path, reference = gemma3n
    assert_same_run(run_greedy(path, max_num_batched_tokens=budget), reference)


def _as_conditional_generation(path: str, folder: Path) -> str:
    """The checkpoint as the released class saves it: `Gemma3nConfig` around the text config,
    the text weights under `model.language_model.`, plus vision / audio tower tensors (random,
    under their real prefixes: transformers cannot build the vision tower without timm)."""
    folder.mkdir()
    text = Gemma3nTextConfig.from_pretrained(path)
    config = Gemma3nConfig(text_config=text.to_dict()).to_dict()
    config["architectures"] = ["Gemma3nForConditionalGeneration"]
    (folder / "config.json").write_text(json.dumps(config))
    state = {name.replace("model.", "model.language_model.", 1): tensor
             for name, tensor in load_file(os.path.join(path, "model.safetensors")).items()}
    for name in TOWER_WEIGHTS:
        state[name] = torch.randn(4, 4)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


TOWER_WEIGHTS = ("model.vision_tower.timm_model.conv_stem.conv.weight",
                 "model.audio_tower.subsample_conv_projection.conv_0.conv.weight",
                 "model.embed_vision.embedding_projection.weight",
                 "model.embed_audio.embedding.weight")


def test_gemma3n_conditional_generation_served_text_only(gemma3n, tmp_path, caplog):
    path, reference = gemma3n
    folder = _as_conditional_generation(path, tmp_path / "multimodal")
    with caplog.at_level(logging.INFO, logger="minivllm.model_executor.models.gemma3n"):
        model = build_model(folder)
    assert type(model).__name__ == "Gemma3nForConditionalGeneration"
    assert not any("tower" in name or "embed_vision" in name for name, _ in
                   model.named_parameters())
    skipped = [r.getMessage() for r in caplog.records if "tower" in r.getMessage()]
    assert len(skipped) == 1 and "skipped 4 vision / audio tower weights" in skipped[0]
    assert_same_run(run_greedy(folder, max_num_batched_tokens=512), reference)


def test_gemma3n_layers_follow_the_config(gemma3n_path):
    model = build_model(gemma3n_path)
    layers = model.model.layers
    assert [type(layer.mlp.act_fn).__name__ for layer in layers] == \
        ["GeluAndMulSparse"] * 2 + ["GeluAndMul"] * 3
    assert [layer.mlp.act_fn.activation_sparsity for layer in layers[:2]] == [0.95, 0.5]
    assert [layer.mlp.down_proj.weight.shape[1] for layer in layers] == [128, 96, 128, 64, 128]
    attns = [layer.self_attn for layer in layers]
    assert [a.attn.sliding_window for a in attns] == [16, 16, None, 16, None]
    assert [a.attn.kv_sharing_target_layer_name for a in attns[3:]] == \
        ["model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"]
    assert all(a.attn.scale == 1.0 for a in attns)
    assert len(model.model.altup_projections) == len(model.model.altup_unembed_projections) == 3
    assert model.logits_processor.soft_cap == 30.0
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_gemma3n_prefixes_and_bad_names(gemma3n_path, tmp_path):
    assert_prefixes_clean(gemma3n_path, "Gemma3nForCausalLM")
    assert_bad_names_reported(gemma3n_path, tmp_path / "broken",
                              drop=["model.layers.0.altup.correct_output_scale",
                                    "model.layers.1.laurel.linear_left.weight",
                                    "model.embed_tokens_per_layer.weight"])


def test_gemma3n_unknown_activation_is_named(gemma3n_path, tmp_path):
    folder = tmp_path / "silu"
    shutil.copytree(gemma3n_path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_activation": "silu"}))
    with pytest.raises(ValueError, match="hidden_activation='silu'"):
        build_model(str(folder))


def test_gemma3n_registered_as_minivllms_own():
    for arch in ("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration"):
        cls = ModelRegistry.resolve_model_cls([arch])[0]
        assert cls.__module__ == "minivllm.model_executor.models.gemma3n" and cls.__name__ == arch


@pytest.mark.slow
def test_gemma3n_tp2_matches_one_process(gemma3n_path):
    """Heads, MLPs (and the sparse gates' statistics) and the vocabularies split over 2 ranks."""
    assert_parallel_matches_one_process(gemma3n_path, tensor_parallel_size=2)


@pytest.mark.slow
def test_gemma3n_pp2_carries_streams_and_per_layer_inputs(tmp_path):
    """The AltUp streams and per-layer inputs built on the first stage reach the second one's
    layers. No KV sharing: a sharing layer must sit on its target's stage."""
    path = write_gemma3n_checkpoint(tmp_path, num_kv_shared_layers=0)
    assert_parallel_matches_one_process(path, pipeline_parallel_size=2)
