"""The engine on a real (tiny) model: batching, preemption and prefix caching never change greedy tokens."""

import pytest
import torch

from minivllm import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 1000, (24,), generator=gen).tolist()   # a common prefix for caching
    return [shared + torch.randint(3, 1000, (int(n),), generator=gen).tolist()
            for n in torch.randint(1, 30, (16,), generator=gen)]


@pytest.fixture(scope="module")
def alone(tiny_llama_factory, prompts) -> list[list[int]]:
    llm = LLM(model=tiny_llama_factory(), dtype="float32", block_size=4)
    return [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_16_at_once_with_forced_preemption_equals_alone(tiny_llama_factory, prompts, alone,
                                                        prefix_caching):
    # 40 blocks of 4 tokens cannot hold 16 sequences of ~60 tokens: the scheduler must preempt.
    llm = LLM(model=tiny_llama_factory(), dtype="float32", block_size=4, num_gpu_blocks_override=40,
              max_model_len=128, enable_prefix_caching=prefix_caching)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert llm.llm_engine.scheduler.num_preemptions_total > 0


def test_seeded_sampling_is_independent_of_the_batch(tiny_llama_factory, prompts):
    llm = LLM(model=tiny_llama_factory(), dtype="float32", block_size=4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(prompts[:5], [seeded] + [other] * 4, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    n2 = llm.generate([prompts[0]], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert len(n2.outputs) == 2 and n2.outputs[0].token_ids != n2.outputs[1].token_ids
