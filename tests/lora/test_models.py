"""Adapters read from PEFT folders give transformers + PEFT's greedy tokens and logprobs (fp32),
unmerged and merged; adapters that do not fit the model are refused with one clear error."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM
from minivllm.lora.request import LoRARequest
from tests.lora._lora_helpers import edit_adapter, hf_reference, run

PROMPTS = [[5, 17, 300, 42, 7, 99, 3, 250, 11], [400, 8, 61, 2, 77]]
TOL = 1e-4


@pytest.fixture(scope="module")
def llm(lora_base):
    llm = LLM(lora_base, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
              max_cpu_loras=4, block_size=4, num_gpu_blocks_override=128, max_model_len=64)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("name", ["attn", "all", "rslora"])
def test_matches_transformers_peft_unmerged_and_merged(llm, lora_base, adapters, name):
    lora = LoRARequest(name, {"attn": 1, "all": 2, "rslora": 3}[name], adapters[name])
    ours = run(llm, PROMPTS, lora)
    base = run(llm, PROMPTS)
    for prompt, (tokens, logprobs), (base_tokens, _) in zip(PROMPTS, ours, base):
        for merged in (False, True):
            ref_tokens, ref_logprobs = hf_reference(lora_base, adapters[name], prompt, merged)
            assert tokens == ref_tokens, (merged, tokens, ref_tokens)
            torch.testing.assert_close(logprobs, ref_logprobs, atol=TOL, rtol=0)
        assert tokens != base_tokens      # the adapter really changes the output


def test_base_requests_stay_base_model(llm, lora_base):
    for prompt, (tokens, logprobs) in zip(PROMPTS, run(llm, PROMPTS)):
        ref_tokens, ref_logprobs = hf_reference(lora_base, None, prompt)
        assert tokens == ref_tokens
        torch.testing.assert_close(logprobs, ref_logprobs, atol=TOL, rtol=0)


def test_add_list_remove(llm, adapters):
    assert llm.add_lora(LoRARequest("r4", 9, adapters["r4"]))
    assert 9 in llm.list_loras()
    assert llm.remove_lora(9)
    assert 9 not in llm.list_loras()
    with pytest.raises(ValueError, match="already adapter 'attn'"):
        llm.add_lora(LoRARequest("attn", 10, adapters["attn"]))
        llm.add_lora(LoRARequest("other", 10, adapters["all"]))


def _bad(tmp_path, adapters, **changes) -> str:
    return edit_adapter(adapters["attn"], str(tmp_path / "bad"), **changes)


@pytest.mark.parametrize("changes, message", [
    (dict(target_modules=["q_proj", "foo_proj", "embed_tokens"]),
     r"\['embed_tokens', 'foo_proj'\] match no module.*valid target modules: down_proj, "
     r"gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
    (dict(target_modules=r".*\.mlp\.nothing"), "regex .* matches no module"),
    (dict(r=32), "LoRA rank 32 is greater than max_lora_rank 16"),
    (dict(modules_to_save=["lm_head"]), r"modules_to_save=\['lm_head'\] is not supported"),
    (dict(bias="all"), "bias='all' is not supported.*supported: none"),
    (dict(use_dora=True), "DoRA"),
    # fields of the wrong JSON type (they were TypeErrors deeper in)
    (dict(r="8"), "r must be a positive integer, not '8'"),
    (dict(target_modules=5), "target_modules must be a regex string or a list"),
    (dict(rank_pattern={"q_proj": "4"}), "rank_pattern must be an object of positive integers"),
])
def test_bad_adapter_configs_are_refused(llm, adapters, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        llm.add_lora(LoRARequest("bad", 20, _bad(tmp_path, adapters, **changes)))
    assert 20 not in llm.list_loras()


def test_weights_for_unknown_modules_are_listed(llm, adapters, tmp_path):
    folder = _bad(tmp_path, adapters)
    path = os.path.join(folder, "adapter_model.safetensors")
    tensors = load_file(path)
    for kind in ("A", "B"):
        key = f"base_model.model.model.layers.0.self_attn.q_proj.lora_{kind}.weight"
        tensors[key.replace("q_proj", "rotary")] = tensors[key].clone()
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"cannot adapt: model\.layers\.0\.self_attn\.rotary; "
                                         "valid target modules: down_proj"):
        llm.add_lora(LoRARequest("bad", 21, folder))


def test_a_config_that_is_no_json_object_is_refused(llm, tmp_path):
    (tmp_path / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object, not list"):
        llm.add_lora(LoRARequest("bad", 23, str(tmp_path)))


def test_missing_folder_and_bad_request(llm, tmp_path):
    with pytest.raises(ValueError, match="No adapter_config.json in LoRA adapter folder"):
        llm.generate([PROMPTS[0]], lora_request=LoRARequest("x", 22, str(tmp_path / "nope")),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, str(tmp_path))
    with pytest.raises(ValueError, match="2 prompts but 1 lora requests"):
        llm.generate(PROMPTS, lora_request=[None], use_tqdm=False)


def test_rank_above_max_in_weights(llm, adapters, tmp_path):
    """The rank the weights have counts, not only the config's r (rank_pattern)."""
    folder = _bad(tmp_path, adapters, rank_pattern={"q_proj": 4})
    with open(os.path.join(folder, "adapter_config.json")) as f:
        assert json.load(f)["rank_pattern"] == {"q_proj": 4}
    # rank_pattern changes only the scaling of q_proj: alpha / 4 instead of alpha / 8
    from minivllm.lora.peft_helper import PEFTHelper
    peft = PEFTHelper.from_local_dir(folder)
    assert peft.scaling("model.layers.0.self_attn.q_proj") == 16 / 4
    assert peft.scaling("model.layers.0.self_attn.k_proj") == 16 / 8


def test_lora_request_while_disabled(lora_base, adapters):
    llm = LLM(lora_base, dtype="float32", block_size=4, num_gpu_blocks_override=32,
              max_model_len=64)
    try:
        with pytest.raises(ValueError, match="LoRA is disabled.*enable_lora=True"):
            llm.generate([PROMPTS[0]], lora_request=LoRARequest("a", 1, adapters["attn"]),
                         use_tqdm=False)
        with pytest.raises(ValueError, match="--enable-lora"):
            llm.list_loras()
    finally:
        llm.shutdown()
