"""The slot table in use: one batch mixing adapters and the base model, more adapters than
slots (LRU swapping), and prefix caching that never shares KV blocks between adapters."""

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.lora.request import LoRARequest
from tests.lora._lora_helpers import run

NAMES = ["attn", "all", "rslora", "r4"]
PROMPTS = [[5, 17, 300, 42, 7, 99, 3, 250, 11], [400, 8, 61, 2, 77], [9, 8, 7, 6, 5, 4, 3],
           [12, 600, 13, 14]]


def _engine(lora_base, **kwargs) -> LLM:
    return LLM(lora_base, dtype="float32", enable_lora=True, max_lora_rank=16, block_size=4,
               num_gpu_blocks_override=128, max_model_len=64, **kwargs)


@pytest.fixture(scope="module")
def loras(adapters) -> list[LoRARequest]:
    return [LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(NAMES)]


@pytest.fixture(scope="module")
def alone(lora_base, loras):
    """Each (prompt, adapter or None) run on its own, in an engine with enough slots."""
    llm = _engine(lora_base, max_loras=4)
    results = {}
    for p, prompt in enumerate(PROMPTS):
        for lora in [None, *loras]:
            results[p, lora.lora_int_id if lora else 0] = run(llm, [prompt], lora)[0]
    yield results, llm
    llm.shutdown()


def _assert_same(got, want):
    assert got[0] == want[0]
    # The same slot table and products; only the batch composition differs.
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)


def test_one_batch_mixes_three_adapters_and_the_base_model(alone, loras):
    results, llm = alone
    # Every prompt with every choice, interleaved, in one generate call: mixed steps.
    pairs = [(p, lora) for p in range(len(PROMPTS)) for lora in [None, *loras[:3]]]
    outs = run(llm, [PROMPTS[p] for p, _ in pairs], [lora for _, lora in pairs])
    for (p, lora), got in zip(pairs, outs):
        _assert_same(got, results[p, lora.lora_int_id if lora else 0])
    # and the adapters really differ from each other and from the base model
    assert len({tuple(results[0, i][0]) for i in range(4)}) == 4


def test_more_adapters_than_slots_all_finish(lora_base, alone, loras):
    results, _ = alone
    llm = _engine(lora_base, max_loras=2, max_cpu_loras=3)   # 4 adapters: slots and cache swap
    try:
        pairs = [(p, lora) for p in range(len(PROMPTS)) for lora in loras] + [(0, None)]
        outs = run(llm, [PROMPTS[p] for p, _ in pairs], [lora for _, lora in pairs])
        for (p, lora), got in zip(pairs, outs):
            _assert_same(got, results[p, lora.lora_int_id if lora else 0])
        manager = llm.llm_engine.executor.worker.model_runner.lora_manager.manager
        assert len(manager.list_adapters()) <= 3
    finally:
        llm.shutdown()


def test_scheduler_keeps_distinct_adapters_per_step_within_slots(lora_base, loras):
    llm = _engine(lora_base, max_loras=2, max_cpu_loras=4)
    try:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for i, lora in enumerate(loras * 2):
            engine.add_request(str(i), PROMPTS[i % 4], params, lora_request=lora)
        engine.add_request("base", PROMPTS[0], params)
        seen = set()
        while engine.has_unfinished_requests():
            running = {r.lora_int_id for r in engine.scheduler.running} - {0}
            assert len(running) <= 2
            engine.step()
            seen |= {r.lora_int_id for r in engine.scheduler.running}
        assert seen >= {1, 2, 3, 4}
    finally:
        llm.shutdown()


def test_prefix_cache_never_shares_blocks_between_adapters(alone, loras):
    _, llm = alone
    prompt = list(range(20, 40))          # 5 full blocks of 4
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    first_a = llm.generate([prompt], params, lora_request=loras[0], use_tqdm=False)[0]
    again_a = llm.generate([prompt], params, lora_request=loras[0], use_tqdm=False)[0]
    first_b = llm.generate([prompt], params, lora_request=loras[1], use_tqdm=False)[0]
    base = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again_a.num_cached_tokens == 16          # the same adapter hits its own blocks
    assert first_b.num_cached_tokens == 0           # another adapter hits none of them
    assert base.num_cached_tokens == 0
    lp = [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob
          for o in (first_a, again_a, first_b, base)]
    assert abs(lp[0] - lp[1]) < 1e-5
    assert abs(lp[0] - lp[2]) > 1e-3 and abs(lp[2] - lp[3]) > 1e-3


def _prompt_logprobs(llm, prompts, loras) -> list[torch.Tensor]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return [torch.tensor([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
            for p, o in zip(prompts, outs)]


def test_bf16_mixed_batch_follows_fp32(lora_base, loras, alone):
    """bf16 (a step of <= 64 tokens goes through the native kernel where it builds): a batch
    of four adapters and the base model gives each prompt its fp32 prompt logprobs within bf16
    error, far closer than the adapters are to each other."""
    _, fp32_llm = alone
    choices = [None, *loras]
    prompts = [PROMPTS[0] + [i + 50] for i in range(len(choices))]       # 5 x 10 tokens
    want = _prompt_logprobs(fp32_llm, prompts, choices)
    llm = LLM(lora_base, dtype="bfloat16", enable_lora=True, max_lora_rank=16, max_loras=4,
              block_size=4, num_gpu_blocks_override=128, max_model_len=64)
    try:
        got = _prompt_logprobs(llm, prompts, choices)
    finally:
        llm.shutdown()
    base = _prompt_logprobs(fp32_llm, prompts, [None] * len(prompts))
    for g, w, b, lora in zip(got, want, base, choices):
        torch.testing.assert_close(g, w, atol=0.06, rtol=0)
        if lora is not None:
            assert (w - b).abs().max() > 0.3     # the adapter's effect dwarfs the tolerance
