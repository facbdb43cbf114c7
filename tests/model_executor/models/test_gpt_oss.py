"""gpt-oss (attention sinks, sliding windows on alternate layers, YaRN, biased router and
swigluoai experts stored fused) against transformers on tiny random checkpoints."""

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean, make_prompts,
                                                         minivllm_greedy, write_tiny_checkpoint)

# An 8-token window on layer 0 (layer 1 full): the 60-token prompts cross it. A small YaRN
# table (original context 64, factor 4) that the prompts also cross.
TINY_GPT_OSS = dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    head_dim=16, sliding_window=8, initializer_range=0.1,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                     "original_max_position_embeddings": 64})


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory) -> str:
    from safetensors.torch import load_file, save_file

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("gpt_oss"), GptOssConfig,
                                 GptOssForCausalLM, **TINY_GPT_OSS)
    assert GptOssConfig.from_pretrained(path).layer_types == ["sliding_attention",
                                                              "full_attention"]
    # transformers starts every bias at zero: random ones, so that each bias path is checked.
    state = load_file(f"{path}/model.safetensors")
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in state if n.endswith("bias")]:
        state[name] = state[name] + 0.2 * torch.randn(state[name].shape, generator=gen)
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


def test_gpt_oss_matches_transformers(gpt_oss_path):
    assert_matches_transformers(gpt_oss_path)


def test_gpt_oss_large_sinks_match_transformers(gpt_oss_path, tmp_path):
    """Every sink logit at 3.0 (they then take most of each softmax): still transformers'
    tokens and logprobs, so the backend neither drops nor mis-scales them."""
    from safetensors.torch import load_file, save_file

    state = load_file(f"{gpt_oss_path}/model.safetensors")
    for name in [n for n in state if n.endswith("sinks")]:
        state[name] = torch.full_like(state[name], 3.0)
    folder = tmp_path / "big_sinks"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(open(f"{gpt_oss_path}/config.json").read())
    assert_matches_transformers(str(folder), prompts=make_prompts(1000, lens=(9, 40)),
                                num_tokens=8)


def test_gpt_oss_bf16_close_to_transformers_fp32(gpt_oss_path):
    """bf16 (native AMX experts where they apply) stays close to the fp32 reference."""
    from tests.model_executor.models._family_helpers import hf_greedy

    from minivllm import LLM

    prompts = make_prompts(1000, lens=(33,))
    ref_lp = hf_greedy(gpt_oss_path, prompts, num_tokens=1)[0][1]
    llm = LLM(model=gpt_oss_path, dtype="bfloat16", block_size=4)
    ours = minivllm_greedy(llm, prompts, num_tokens=1)[0][1]
    assert (ours - ref_lp).abs().mean() < 0.05


def test_gpt_oss_prefixes_and_bad_names(gpt_oss_path, tmp_path):
    assert_prefixes_clean(gpt_oss_path, "GptOssForCausalLM")
    assert_bad_names_reported(gpt_oss_path, tmp_path / "broken",
                              drop=["model.layers.1.self_attn.sinks",
                                    "model.layers.0.mlp.experts.down_proj_bias"],
                              missing=["model.layers.1.self_attn.sinks",
                                       "model.layers.0.mlp.experts.w2_bias"])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "tp2_ep"])
def test_gpt_oss_tp2_matches_tp1(gpt_oss_path, parallel):
    """Sinks split by head, expert biases sliced (w13) or added once (w2) under TP; whole
    experts with their biases under EP."""
    from minivllm import LLM
    from tests._parallel_helpers import engine_kwargs, greedy_run, prompts

    ref = greedy_run(LLM(model=gpt_oss_path, **engine_kwargs()), prompts())
    llm = LLM(model=gpt_oss_path, **engine_kwargs(**parallel))
    tokens, logprobs = greedy_run(llm, prompts())
    llm.shutdown()
    assert tokens == ref[0]
    assert (logprobs - ref[1]).abs().max().item() <= 1e-4
