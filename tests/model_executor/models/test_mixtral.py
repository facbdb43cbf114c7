"""Mixtral (every layer sparse, w1/w2/w3 expert names, block_sparse_moe) against transformers."""

import pytest
from transformers import MixtralConfig, MixtralForCausalLM

from tests.model_executor.models._family_helpers import (assert_bad_names_reported,
                                                         assert_matches_transformers,
                                                         assert_prefixes_clean,
                                                         write_tiny_checkpoint)

TINY_MOE = dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def mixtral_path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mixtral"), MixtralConfig,
                                 MixtralForCausalLM, **TINY_MOE)


def test_mixtral_matches_transformers(mixtral_path):
    assert_matches_transformers(mixtral_path)


def test_mixtral_sliding_window_matches_transformers(tmp_path):
    path = write_tiny_checkpoint(tmp_path, MixtralConfig, MixtralForCausalLM, seed=1,
                                 sliding_window=16, **TINY_MOE)
    assert_matches_transformers(path)


def test_mixtral_prefixes_and_bad_names(mixtral_path, tmp_path):
    assert_prefixes_clean(mixtral_path, "MixtralForCausalLM")
    assert_bad_names_reported(
        mixtral_path, tmp_path / "broken",
        drop=["model.layers.1.block_sparse_moe.experts.2.w3.weight",
              "model.layers.0.block_sparse_moe.gate.weight"],
        missing=["model.layers.1.mlp.experts.w13_weight", "model.layers.0.mlp.gate.weight"])


@pytest.mark.requires_native
def test_bf16_decode_steps_replay_from_cpu_graphs(tmp_path):
    """bf16 on AMX: routing and experts are two native calls, so a whole MoE decode step is
    recorded once and replayed; replays give the eager steps' tokens and logprobs bit for bit."""
    from minivllm import LLM, SamplingParams
    from minivllm import _custom_ops as ops

    if not ops.native_available() or not ops._has_amx:
        pytest.skip("no AMX here: bf16 experts stay in torch, so steps are not recordable")
    # 16 experts: the router's [16, 64] weight takes the native GEMM (N % 16 == 0).
    path = write_tiny_checkpoint(tmp_path, MixtralConfig, MixtralForCausalLM, seed=2,
                                 intermediate_size=32, num_local_experts=16,
                                 num_experts_per_tok=2, head_dim=32)
    runs = []
    for mode in ("FULL_DECODE_ONLY", "NONE"):
        llm = LLM(model=path, dtype="bfloat16", compilation_config={"cudagraph_mode": mode})
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
                  for n in (6, 9)]
        outs = llm.generate([[5, 17, 80, 3], [9, 400, 23, 11, 7, 19]], params, use_tqdm=False)
        runs.append(([list(o.outputs[0].token_ids) for o in outs],
                     [[{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs]
                      for o in outs], llm.llm_engine.executor.worker.model_runner.cpu_graphs))
    (tokens, logprobs, graphs), (ref_tokens, ref_logprobs, _) = runs
    assert sorted(graphs.entries) == [1, 2] and graphs.num_replays > 0
    assert tokens == ref_tokens and logprobs == ref_logprobs
