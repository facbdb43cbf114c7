"""minivllm's own Qwen3.5 text files, dense and MoE (Qwen3-Next's hybrid stack with flat Gated
DeltaNet projections and interleaved-M-RoPE configs), against transformers: whole prompts and
chunks of 8, prefixes, bad names (flat shards), the VL prefix, TP=2 (slow), preemption (slow)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig)

from tests._parallel_helpers import assert_parallel_matches_one_process
from tests.model_executor.models._family_helpers import (TINY_DENSE, assert_bad_names_reported,
                                                         assert_preemption_keeps_tokens,
                                                         assert_prefixes_clean, build_model,
                                                         hf_greedy, write_tiny_checkpoint)
from tests.model_executor.models.test_qwen3_next import (NUM_TOKENS, PROMPTS,
                                                         assert_matches_reference)
from tests.model_executor.models._family_helpers import STATE_BUDGETS

# linear / full / linear / full attention; 2 key heads serving 4 value heads; interleaved
# M-RoPE over a quarter of each head, as the released configs have it.
TINY_QWEN3_5 = dict(
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                     "mrope_interleaved": True})
# 4 experts top-2 plus the gated shared expert on every layer; no dense MLP width.
TINY_QWEN3_5_MOE = dict(TINY_QWEN3_5, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=48,
                        intermediate_size=None)


@pytest.fixture(scope="module")
def qwen3_5_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5"), Qwen3_5TextConfig,
                                 Qwen3_5ForCausalLM, **TINY_QWEN3_5)


@pytest.fixture(scope="module")
def qwen3_5_moe_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe"), Qwen3_5MoeTextConfig,
                                 Qwen3_5MoeForCausalLM, **TINY_QWEN3_5_MOE)


_REFERENCES: dict[str, list] = {}     # transformers' run, once per checkpoint


@STATE_BUDGETS
@pytest.mark.parametrize("variant", ["qwen3_5_path", "qwen3_5_moe_path"], ids=["dense", "moe"])
def test_qwen3_5_matches_transformers(request, variant, budget):
    path = request.getfixturevalue(variant)
    if path not in _REFERENCES:
        _REFERENCES[path] = hf_greedy(path, PROMPTS, NUM_TOKENS)
    assert_matches_reference(path, _REFERENCES[path], budget)


def test_qwen3_5_classes_and_capabilities(qwen3_5_path, qwen3_5_moe_path):
    from minivllm.model_executor.models.interfaces import is_mixture_of_experts

    dense, moe = build_model(qwen3_5_path), build_model(qwen3_5_moe_path)
    for model, name in ((dense, "Qwen3_5ForCausalLM"), (moe, "Qwen3_5MoeForCausalLM")):
        assert type(model).__name__ == name and model.is_hybrid and model.has_inner_state
        assert type(model).__module__ == "minivllm.model_executor.models.qwen3_5"
        assert not model.model.layers[0].linear_attn.gqa_interleaved_layout
    assert not is_mixture_of_experts(dense) and dense.get_expert_mapping() == []
    assert is_mixture_of_experts(moe) and moe.num_moe_layers == 4
    assert moe.packed_modules_mapping["in_proj_ba"] == ["in_proj_b", "in_proj_a"]


def test_qwen3_5_prefixes_and_bad_names(qwen3_5_path, qwen3_5_moe_path, tmp_path):
    assert_prefixes_clean(qwen3_5_path, "Qwen3_5ForCausalLM")
    assert_prefixes_clean(qwen3_5_moe_path, "Qwen3_5MoeForCausalLM")
    # A missing flat projection is a missing shard of the fused one.
    assert_bad_names_reported(
        qwen3_5_moe_path, tmp_path / "broken",
        drop=["model.layers.0.linear_attn.in_proj_z.weight",
              "model.layers.3.self_attn.k_norm.weight", "model.norm.weight"],
        missing=["model.layers.0.linear_attn.in_proj_qkvz.weight",
                 "model.layers.3.self_attn.k_norm.weight", "model.norm.weight"])


def test_qwen3_5_language_model_prefix_and_mtp_are_handled(qwen3_5_path, tmp_path):
    """Text-only checkpoints cut from the VL model keep `model.language_model.`, and MTP
    weights ride along: both load as the plain checkpoint does."""
    folder = tmp_path / "vl_prefixed"
    shutil.copytree(qwen3_5_path, folder)
    file = folder / "model.safetensors"
    state = {name.replace("model.", "model.language_model.", 1): w
             for name, w in load_file(file).items()}
    state["mtp.norm.weight"] = torch.zeros(64)
    save_file(state, file, metadata={"format": "pt"})
    ours, ref = build_model(str(folder)), build_model(qwen3_5_path)
    for (name, p), (ref_name, ref_p) in zip(ours.named_parameters(), ref.named_parameters()):
        assert name == ref_name and torch.equal(p, ref_p)


@pytest.mark.slow      # ~10 s; qwen3_next's TP=2 test covers the interleaved layout by default
def test_qwen3_5_moe_at_tp2_equals_one_process(qwen3_5_moe_path):
    # Flat shards: each rank takes its half of q, k, v and z, of b and a.
    assert_parallel_matches_one_process(qwen3_5_moe_path, tensor_parallel_size=2)


@pytest.mark.slow      # ~15 s: transformers' references for 6 prompts of 24 tokens
def test_qwen3_5_preempted_sequences_restart_their_state(qwen3_5_path):
    assert_preemption_keeps_tokens(qwen3_5_path)


# A vision tower as small as transformers allows: one block, 32 wide, merged out to hidden 64.
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                   out_hidden_size=64, patch_size=4, num_position_embeddings=16)


def _write_vl_checkpoint(folder, config_cls: type, model_cls: type, text: dict) -> str:
    """A random fp32 vision-language checkpoint (norms perturbed, as write_tiny_checkpoint)."""
    torch.manual_seed(0)
    fields = {k: v for k, v in {**TINY_DENSE, **text}.items() if v is not None}
    config = config_cls(text_config=fields, vision_config=TINY_VISION,
                        tie_word_embeddings=False)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    return str(folder)


@pytest.mark.parametrize("variant", ["dense", pytest.param("moe", marks=pytest.mark.slow)])
def test_qwen3_5_vl_checkpoint_served_text_only(tmp_path, variant):
    """`Qwen3_5(Moe)ForConditionalGeneration` folders run as their language model: the same
    tokens and logprobs as transformers (whose AutoModelForCausalLM also loads only the
    language model; checked here against the VL class on one prompt), chunks of 8; the
    vision tower's weights are skipped and every language-model weight is loaded."""
    from transformers import (AutoModelForCausalLM, Qwen3_5Config,
                              Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)

    config_cls, model_cls, text = {
        "dense": (Qwen3_5Config, Qwen3_5ForConditionalGeneration, TINY_QWEN3_5),
        "moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, TINY_QWEN3_5_MOE)}[variant]
    path = _write_vl_checkpoint(tmp_path / variant, config_cls, model_cls, text)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        vl_logits = model_cls.from_pretrained(path, dtype=torch.float32)(ids).logits
        text_logits = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(text_logits, vl_logits, rtol=0, atol=1e-5)
    model = build_model(path)
    assert type(model).__name__ == model_cls.__name__ and model.is_hybrid
    assert not any("visual" in name for name, _ in model.named_parameters())
    # The context length comes from the text config (the top-level VL config has none).
    from minivllm.config import ModelConfig
    assert (ModelConfig(model=path).max_model_len
            == AutoModelForCausalLM.from_pretrained(path).config.max_position_embeddings != 2048)
    prompts = PROMPTS[:2]                # two short prompts: transformers' run is most of the time
    assert_matches_reference(path, hf_greedy(path, prompts, 8), budget=8, prompts=prompts,
                             num_tokens=8)


@pytest.mark.slow      # ~15 s: transformers + PEFT reference
def test_qwen3_5_lora_matches_peft(qwen3_5_path, tmp_path):
    """A PEFT adapter on the gated q_proj, the GDN's in_proj_b / in_proj_a / out_proj and the
    MLP matches transformers + PEFT; one naming in_proj_qkv (three of in_proj_qkvz's shards)
    is refused with the valid targets, not mis-sliced."""
    from minivllm import LLM
    from minivllm.lora.request import LoRARequest
    from tests.lora._lora_helpers import assert_adapter_matches_peft, write_adapter

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_b", "in_proj_a", "out_proj",
               "gate_proj", "up_proj", "down_proj"]
    adapter = write_adapter(qwen3_5_path, str(tmp_path / "ok"), 1, targets)
    llm = LLM(qwen3_5_path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              block_size=4)
    assert_adapter_matches_peft(llm, qwen3_5_path, adapter, [PROMPTS[0]],
                                LoRARequest("ok", 1, adapter))
    refused = write_adapter(qwen3_5_path, str(tmp_path / "qkv"), 2, ["in_proj_qkv"])
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        llm.add_lora(LoRARequest("qkv", 2, refused))
