"""Shared by the multi-process tests (engine/test_multiproc_executor.py, worker/test_launcher.py):
a greedy run with logprobs, and process-tree checks."""

import time

import psutil
import torch

from minivllm import LLM, SamplingParams

# Four layers split unevenly over three PP stages (1, 2, 1); two KV heads, so TP=4 replicates them.
TINY = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
PROMPT_LENS = [5, 19, 42]
NUM_TOKENS = 8


def prompts(vocab_size: int = 1000) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def greedy_run(llm: LLM, prompt_ids: list[list[int]], num_tokens: int = NUM_TOKENS):
    """(tokens per prompt, every prompt and sampled token's logprob as one flat tensor)."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    tokens, logprobs = [], []
    for ids, out in zip(prompt_ids, outputs):
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        logprobs += [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        logprobs += [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
    return tokens, torch.tensor(logprobs, dtype=torch.float64)


def engine_kwargs(**overrides) -> dict:
    # Small blocks and a small token budget: prompts are chunked and blocks cross chunk edges.
    # A fixed small cache: the default budget (1 GiB per rank) would be zeroed in every process.
    return dict(dtype="float32", block_size=4, max_num_batched_tokens=32,
                num_gpu_blocks_override=256, **overrides)


def live_children(pid: int | None = None) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(pid).children(recursive=True)
                if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.NoSuchProcess:
        return []


def wait_until_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Pids still alive (not zombies) after waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def assert_parallel_matches_one_process(path: str, atol: float = 1e-4, **parallel) -> None:
    """`LLM(path, **parallel)` over real worker processes gives the one-process greedy tokens,
    logprobs within `atol` (e.g. parallel = {"tensor_parallel_size": 2})."""
    ref_tokens, ref_logprobs = greedy_run(LLM(model=path, **engine_kwargs()), prompts())
    llm = LLM(model=path, **parallel, **engine_kwargs())
    assert len(live_children()) == (parallel.get("tensor_parallel_size", 1)
                                    * parallel.get("pipeline_parallel_size", 1))
    tokens, logprobs = greedy_run(llm, prompts())
    llm.shutdown()
    assert tokens == ref_tokens
    assert (logprobs - ref_logprobs).abs().max().item() <= atol
