"""Llama through the model-file contract matches transformers' LlamaForCausalLM (fp32, CPU)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams

PROMPT_LENS = [5, 17, 33, 60]
NUM_TOKENS = 32
CONFIGS = {
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True, vocab_size=1024),
    "gqa_bias_odd_vocab": dict(attention_bias=True, vocab_size=1000),
    "head_dim_llama3": dict(head_dim=32, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear_rope_kv1": dict(num_key_value_heads=1, vocab_size=333, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
}


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@torch.inference_mode()
def _hf_reference(path: str, prompts: list[list[int]]):
    """Greedy tokens and per-position logprobs (prompt and generated) from transformers."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    for ids in prompts:
        seq = list(ids)
        for _ in range(NUM_TOKENS):
            logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
        logprobs = torch.log_softmax(model(torch.tensor([seq])).logits[0].double(), -1)
        chosen = logprobs[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]   # [len - 1]
        results.append((seq[len(ids):], chosen))
    return results


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama_matches_transformers(tiny_llama_factory, name):
    path = tiny_llama_factory(name, **CONFIGS[name])
    vocab = CONFIGS[name].get("vocab_size", 1000)
    prompts = _prompts(vocab)
    ref = _hf_reference(path, prompts)
    llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    outputs = llm.generate(prompts, params)   # all prompts in one batch
    for ids, out, (ref_tokens, ref_lp) in zip(prompts, outputs, ref):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens
        assert out.prompt_logprobs[0] is None
        prompt_lp = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        gen_lp = [step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)]
        ours = torch.tensor(prompt_lp + gen_lp, dtype=torch.float64)
        assert (ours - ref_lp).abs().max().item() <= 1e-4


def test_decode_next_to_chunked_prefill_matches_alone(tiny_llama_factory):
    """A long prompt forced into chunks, batched with short decoding requests."""
    path = tiny_llama_factory("gqa_bias_odd_vocab", **CONFIGS["gqa_bias_odd_vocab"])
    prompts = _prompts(1000)
    long_prompt = prompts[3] * 3                       # 180 tokens
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone_llm = LLM(model=path, dtype="float32", block_size=4)
    alone = [alone_llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[:2] + [long_prompt]]
    # A budget of 24 tokens splits the long prompt into 8 chunks while the others decode.
    mixed_llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=24,
                    enable_prefix_caching=False)
    mixed = mixed_llm.generate(prompts[:2] + [long_prompt], params)
    assert [o.outputs[0].token_ids for o in mixed] == alone
