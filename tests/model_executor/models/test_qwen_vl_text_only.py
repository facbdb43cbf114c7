"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints, written by transformers' own
ConditionalGeneration classes (tiny vision towers), served text-only by minivllm: fp32 greedy
tokens and every prompt / generated logprob equal the VL class's on the same text prompts."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_executor.models._family_helpers import (TINY_DENSE, build_model, make_prompts,
                                                         minivllm_greedy)

# M-RoPE sections that differ from each other (sectioned for Qwen2-VL, interleaved for Qwen3-VL).
_QWEN2_TEXT = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                    "mrope_section": [2, 3, 3]})
_QWEN3_TEXT = dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                 "mrope_section": [4, 2, 2],
                                                 "mrope_interleaved": True})
# 2 * moe_intermediate_size != hidden: a missed transpose of the fused experts cannot load.
_QWEN3_MOE_TEXT = dict(_QWEN3_TEXT, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=48)
_QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=2,
                     out_hidden_size=64, patch_size=4, num_position_embeddings=16,
                     deepstack_visual_indexes=[0])
# VL class name: (config class name, vision config, text config, tie_word_embeddings)
FAMILIES = {
    "Qwen2VLForConditionalGeneration": (
        "Qwen2VLConfig", dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=1, num_heads=2,
                              patch_size=4, spatial_merge_size=2), _QWEN2_TEXT, False),
    "Qwen2_5_VLForConditionalGeneration": (
        "Qwen2_5_VLConfig", dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                 out_hidden_size=64, patch_size=4, window_size=16,
                                 fullatt_block_indexes=[0]), _QWEN2_TEXT, False),
    # Tied, as Qwen3-VL-2B / 4B are; the MoE untied, against its text config's True default.
    "Qwen3VLForConditionalGeneration": ("Qwen3VLConfig", _QWEN3_VISION, _QWEN3_TEXT, True),
    "Qwen3VLMoeForConditionalGeneration": ("Qwen3VLMoeConfig", _QWEN3_VISION, _QWEN3_MOE_TEXT,
                                           False),
}
PROMPTS = make_prompts(TINY_DENSE["vocab_size"], (5, 17, 33))
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(name)`: the family's tiny checkpoint, written on first use in this module."""
    paths: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in paths:
            paths[name] = _write_checkpoint(tmp_path_factory.mktemp(name), name)
        return paths[name]
    return get


def _write_checkpoint(folder, name: str) -> str:
    import transformers

    config_name, vision, text, tie = FAMILIES[name]
    torch.manual_seed(0)
    fields = {k: v for k, v in {**TINY_DENSE, **text}.items() if k != "tie_word_embeddings"}
    config = getattr(transformers, config_name)(text_config=fields, vision_config=vision,
                                                tie_word_embeddings=tie)
    model = getattr(transformers, name)(config).to(torch.float32).eval()
    with torch.no_grad():    # norms start at 1: a swapped or missed norm would not show
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    return str(folder)


@torch.inference_mode()
def _vl_greedy(path: str, name: str) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' VL class on text only (its own text M-RoPE positions), full recompute per
    token: greedy tokens and the logprob of every token after the first (float64)."""
    import transformers

    model = getattr(transformers, name).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    results = []
    for ids in PROMPTS:
        seq = list(ids)
        for _ in range(NUM_TOKENS):
            seq.append(int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
                           .argmax()))
        logprobs = torch.log_softmax(
            model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].double(), -1)
        results.append((seq[len(ids):],
                        logprobs[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]))
    return results


@pytest.mark.parametrize("name", list(FAMILIES))
def test_qwen_vl_served_text_only_matches_transformers(checkpoint, name):
    from minivllm import LLM

    path = checkpoint(name)
    reference = _vl_greedy(path, name)
    llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=16)
    ours = minivllm_greedy(llm, PROMPTS, NUM_TOKENS)   # chunked prefill: 16-token budget
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(zip(ours, reference)):
        assert tokens == ref_tokens, f"prompt {i}: tokens differ from transformers"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= 1e-4, f"prompt {i}: logprobs differ by {diff:.3g}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_qwen_vl_text_model_structure(checkpoint, name):
    """The class, M-RoPE module and LM-head tying come from the VL config; the vision tower's
    weights are skipped and every language-model weight loads (checkpoint layouts differ)."""
    from minivllm.model_executor.layers.rotary_embedding import MRotaryEmbedding

    path = checkpoint(name)
    saved = load_file(f"{path}/model.safetensors")
    model = build_model(path)
    _, _, text, tie = FAMILIES[name]
    assert type(model).__name__ == name
    assert type(model).__module__ == "minivllm.model_executor.models.qwen_vl"
    assert not any("visual" in n for n, _ in model.named_parameters())
    assert any(n.startswith(("visual.", "model.visual.")) for n in saved)
    rope = model.model.layers[0].self_attn.rotary_emb
    assert isinstance(rope, MRotaryEmbedding)
    assert rope.mrope_section == text["rope_parameters"]["mrope_section"]
    assert rope.mrope_interleaved == text["rope_parameters"].get("mrope_interleaved", False)
    assert ("lm_head.weight" in saved) is not tie
    lm_head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert (lm_head.data_ptr() == embed.data_ptr()) is tie
    if not tie:
        vocab = saved["lm_head.weight"].shape[0]           # minivllm pads the vocabulary
        torch.testing.assert_close(lm_head[:vocab], saved["lm_head.weight"], rtol=0, atol=0)
    key = next(n for n in saved if n.endswith("layers.1.post_attention_layernorm.weight"))
    torch.testing.assert_close(model.model.layers[1].post_attention_layernorm.weight, saved[key],
                               rtol=0, atol=0)


def test_qwen3_vl_moe_released_expert_layout_loads_the_same(checkpoint, tmp_path):
    """Released Qwen3-VL-MoE files store the fused experts transposed (`gate_up_proj
    [E, H, 2I]`, `down_proj [E, I, H]`), transformers 5 saves them as run: both load alike."""
    path = checkpoint("Qwen3VLMoeForConditionalGeneration")
    folder = tmp_path / "released"
    shutil.copytree(path, folder)
    state = load_file(folder / "model.safetensors")
    fused = [n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    assert fused and all(state[n].shape[1] != state[n].shape[2] for n in fused)
    for name in fused:
        state[name] = state[name].transpose(1, 2).contiguous()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    ours, ref = build_model(str(folder)), build_model(path)
    for (name, p), (ref_name, ref_p) in zip(ours.named_parameters(), ref.named_parameters()):
        assert name == ref_name and torch.equal(p, ref_p), name


def test_qwen2_5_vl_pre_v5_flat_config_loads_the_same(checkpoint, tmp_path):
    """Released Qwen2(.5)-VL config.json files are flat, with `rope_scaling: {"type": "mrope",
    "mrope_section": [...]}` (transformers 5 keeps that `type` beside its `rope_type`): the
    same model, M-RoPE sections, theta and untied head as from the nested config."""
    import json

    path = checkpoint("Qwen2_5_VLForConditionalGeneration")
    folder = tmp_path / "flat"
    shutil.copytree(path, folder)
    config = json.loads((folder / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type", None)
    config.update(text, rope_theta=rope["rope_theta"], tie_word_embeddings=False,
                  rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (folder / "config.json").write_text(json.dumps(config))
    ours, ref = build_model(str(folder)), build_model(path)
    rope_module = ours.model.layers[0].self_attn.rotary_emb
    assert rope_module.mrope_section == rope["mrope_section"] and rope_module.base == 1e6
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    for (name, p), (ref_name, ref_p) in zip(ours.named_parameters(), ref.named_parameters()):
        assert name == ref_name and torch.equal(p, ref_p), name
