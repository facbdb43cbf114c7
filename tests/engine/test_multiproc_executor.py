"""TP and PP over real worker processes equal the single-process run (fp32, tiny random Llama;
the default SmolLM2 split 3 ways), and fail early and cleanly when they cannot."""

import gc
import os
import signal
import time

import pytest

from minivllm import LLM, SamplingParams
from tests._parallel_helpers import (TINY, engine_kwargs, greedy_run, live_children, prompts,
                                     wait_until_gone)


@pytest.fixture(scope="module")
def tiny_path(tiny_llama_factory):
    return tiny_llama_factory("dist_tiny", **TINY)


@pytest.fixture(scope="module")
def reference(tiny_path):
    llm = LLM(model=tiny_path, **engine_kwargs())
    return greedy_run(llm, prompts())


@pytest.fixture(autouse=True)
def no_leftover_workers():
    assert live_children() == []
    yield
    assert wait_until_gone([p.pid for p in live_children()]) == []


# TP 4 > 2 KV heads (~10 s: 4 processes on 2 cores) and TP x PP run with the slow tests; the
# KV replication itself is test_linear's test_qkv_shards_and_kv_replication
@pytest.mark.parametrize("tp, pp", [(2, 1), pytest.param(4, 1, marks=pytest.mark.slow), (1, 2),
                                    (1, 3), pytest.param(2, 2, marks=pytest.mark.slow)],
                         ids=["tp2", "tp4_kv_replicated", "pp2", "pp3_uneven", "tp2xpp2"])
def test_parallel_matches_single_process(tiny_path, reference, tp, pp):
    llm = LLM(model=tiny_path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              **engine_kwargs())
    pids = [h.proc.pid for h in llm.executor.workers]
    assert len(pids) == len(live_children()) == tp * pp
    tokens, logprobs = greedy_run(llm, prompts())
    # A second batch on the same workers: state of finished requests was dropped everywhere.
    tokens2, _ = greedy_run(llm, prompts()[:1], num_tokens=3)
    del llm                                       # no shutdown(): the finalizer stops the workers
    gc.collect()
    assert wait_until_gone(pids) == []
    ref_tokens, ref_logprobs = reference
    assert tokens == ref_tokens
    assert tokens2 == [ref_tokens[0][:3]]
    assert (logprobs - ref_logprobs).abs().max().item() <= 1e-4


def test_pp_layer_partition_env_is_honoured(tiny_path, reference, monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    llm = LLM(model=tiny_path, pipeline_parallel_size=2, **engine_kwargs())
    tokens, logprobs = greedy_run(llm, prompts())
    llm.shutdown()
    assert tokens == reference[0]
    assert (logprobs - reference[1]).abs().max().item() <= 1e-4


def test_bad_pp_layer_partition_fails_before_any_process(tiny_path, monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,1")
    with pytest.raises(ValueError, match="sums to 3, but the model has 4 layers"):
        LLM(model=tiny_path, pipeline_parallel_size=2, **engine_kwargs())
    assert live_children() == []


def test_pp_larger_than_layers_fails_before_any_process(tiny_path):
    with pytest.raises(ValueError, match="larger than the number of layers"):
        LLM(model=tiny_path, pipeline_parallel_size=5, **engine_kwargs())
    assert live_children() == []


def test_killed_worker_raises_quickly_and_leaves_no_process(tiny_path):
    llm = LLM(model=tiny_path, tensor_parallel_size=2, **engine_kwargs())
    victim = next(h for h in llm.executor.workers if h.rank == 1).proc.pid
    worker_pids = [h.proc.pid for h in llm.executor.workers]
    execute, steps, killed_at = llm.executor.execute_model, [], []

    def execute_and_kill(scheduler_output):
        steps.append(1)
        if len(steps) == 5:                      # mid-generation: prompts done, decoding
            os.kill(victim, signal.SIGKILL)
            killed_at.append(time.monotonic())
        return execute(scheduler_output)

    llm.executor.execute_model = execute_and_kill
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died with signal SIGKILL"):
        greedy_run(llm, prompts(), num_tokens=200)
    assert time.monotonic() - killed_at[0] < 30
    assert wait_until_gone(worker_pids, timeout_s=5) == []
    with pytest.raises(RuntimeError, match="worker processes failed"):
        greedy_run(llm, prompts())                # the executor stays failed, it does not hang


@pytest.mark.slow   # TP=2 and PP=3 runs of tiny models stay in the default suite
def test_smollm2_tp3_matches_tp1(default_model_path):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = "The capital of France is"
    kwargs = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=16)
    ref = LLM(model=default_model_path, **kwargs).generate(prompt, params, use_tqdm=False)
    llm = LLM(model=default_model_path, tensor_parallel_size=3, **kwargs)
    out = llm.generate(prompt, params, use_tqdm=False)
    llm.shutdown()
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_smollm2_tp2_fails_at_once_with_valid_sizes(default_model_path):
    with pytest.raises(ValueError, match=r"attention heads \(9\).*Valid tensor_parallel_size "
                                         r"values for this model: \[1, 3\]"):
        LLM(model=default_model_path, tensor_parallel_size=2)
    assert live_children() == []
