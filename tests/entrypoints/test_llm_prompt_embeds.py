"""vLLM's prompt embeddings (`EmbedsPrompt`, enable_prompt_embeds): the model reads the given
vectors in place of token embeddings. The embeddings of a prompt's tokens give that prompt's
tokens; other vectors give what transformers gives for the same `inputs_embeds`; the prefix
cache keys the vectors, not the stand-in ids; chunked, batched with token prompts, and at TP=2."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams, TokensPrompt
from minivllm.inputs import EmbedsPrompt
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world, how are you today?",
         "Once upon a time there was a cat.", "A tiny language model for tests."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("embeds_ckpt")))


@pytest.fixture(scope="module")
def llm(checkpoint):
    # A small step budget: long prompts are prefilled in chunks that cross their embeddings.
    return LLM(model=checkpoint, dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
               enable_prompt_embeds=True, max_num_batched_tokens=8, block_size=4)


def _embed(llm: LLM, ids: list[int]) -> torch.Tensor:
    [embeds] = llm.apply_model(lambda model: model.embed_input_ids(torch.tensor(ids)))
    return embeds


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_token_embeddings_give_the_tokens_answer(llm):
    ids = [llm.get_tokenizer().encode(t) for t in TEXTS]
    plain = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], GREEDY,
                         use_tqdm=False)
    expected = _tokens(plain)
    mixed = [EmbedsPrompt(prompt_embeds=_embed(llm, i)) if k % 2 == 0
             else TokensPrompt(prompt_token_ids=i) for k, i in enumerate(ids)]
    outs = llm.generate(mixed, GREEDY, use_tqdm=False)
    assert _tokens(outs) == expected
    assert outs[0].prompt_token_ids is None and outs[1].prompt_token_ids == ids[1]
    assert outs[0].outputs[0].text == plain[0].outputs[0].text
    batched = llm.generate({"prompt_embeds": _embed(llm, ids[2])[None]}, GREEDY, use_tqdm=False)
    assert _tokens(batched) == [expected[2]]   # [1, L, H] is taken as [L, H]


def test_other_vectors_match_transformers(llm, checkpoint):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    table = hf.get_input_embeddings().weight.detach()
    # Mixtures of token embeddings: vectors no token has.
    mix = torch.softmax(torch.randn(2, 11, table.shape[0]) * 3, dim=-1) @ table   # [2, 11, H]
    with torch.no_grad():
        ref = [hf.generate(inputs_embeds=m[None], max_new_tokens=6, do_sample=False,
                           min_new_tokens=6)[0].tolist() for m in mix]
    outs = llm.generate([EmbedsPrompt(prompt_embeds=m) for m in mix], GREEDY, use_tqdm=False)
    assert _tokens(outs) == ref


def test_prefix_cache_keys_the_vectors(llm):
    ids = llm.get_tokenizer().encode(" ".join(TEXTS))[:24]
    embeds = _embed(llm, ids)
    llm.reset_prefix_cache()
    first, again = (llm.generate(EmbedsPrompt(prompt_embeds=embeds), GREEDY, use_tqdm=False)[0]
                    for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 20
    assert _tokens([first]) == _tokens([again])
    other = embeds.clone()
    other[0] += 0.5   # same length, so the same stand-in ids: only the vectors differ
    changed = llm.generate(EmbedsPrompt(prompt_embeds=other), GREEDY, use_tqdm=False)[0]
    assert changed.num_cached_tokens == 0
    plain = llm.generate(TokensPrompt(prompt_token_ids=[0] * 24), GREEDY, use_tqdm=False)[0]
    assert plain.num_cached_tokens == 0
    salted = [llm.generate(EmbedsPrompt(prompt_embeds=embeds, cache_salt="s"), GREEDY,
                           use_tqdm=False)[0].num_cached_tokens for _ in range(2)]
    assert salted == [0, 20]


def test_bad_embeds_name_the_problem(llm, checkpoint):
    hidden = llm.vllm_config.model_config.hf_config.hidden_size
    cases = [(torch.zeros(3, hidden + 1), f"shape \\(num_tokens, {hidden}\\)"),
             (torch.zeros(0, hidden), "shape"), (torch.zeros(3, hidden, dtype=torch.long),
                                                 "floating-point"),
             ([[0.0] * hidden], "floating-point"), (torch.zeros(200, hidden), "max_model_len")]
    for embeds, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(EmbedsPrompt(prompt_embeds=embeds), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs is not available"):
        llm.generate(EmbedsPrompt(prompt_embeds=torch.zeros(3, hidden)),
                     SamplingParams(prompt_logprobs=1), use_tqdm=False)
    kept = llm.generate(EmbedsPrompt(prompt_embeds=torch.randn(200, hidden)), SamplingParams(
        max_tokens=2, truncate_prompt_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(kept.outputs[0].token_ids) == 2
    assert not llm.llm_engine.has_unfinished_requests()
    off = LLM(model=checkpoint, max_model_len=64, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        off.generate(EmbedsPrompt(prompt_embeds=torch.zeros(3, hidden)), GREEDY, use_tqdm=False)


@pytest.mark.parametrize("parallel", [
    {"tensor_parallel_size": 2},
    pytest.param({"pipeline_parallel_size": 2}, marks=pytest.mark.slow)], ids=["tp2", "pp2"])
def test_parallel(llm, checkpoint, parallel):
    ids = llm.get_tokenizer().encode(TEXTS[0])
    embeds = _embed(llm, ids)
    expected = _tokens(llm.generate(TokensPrompt(prompt_token_ids=ids), GREEDY, use_tqdm=False))
    tp = LLM(model=checkpoint, dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
             enable_prompt_embeds=True, **parallel)
    try:
        out = tp.generate([EmbedsPrompt(prompt_embeds=embeds), TokensPrompt(prompt_token_ids=ids)],
                          GREEDY, use_tqdm=False)
        assert _tokens(out) == expected * 2
    finally:
        tp.shutdown()


def test_preemption_recomputes_from_the_vectors(llm, checkpoint):
    """A cache too small for the batch preempts requests; their recomputed prompts are read
    from the vectors again, so the tokens stay those of the token prompts."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ids = [llm.get_tokenizer().encode(t)[:8] for t in TEXTS + TEXTS[:2]]
    expected = _tokens(llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], params,
                                    use_tqdm=False))
    small = LLM(model=checkpoint, dtype="float32", max_model_len=32, block_size=4,
                num_gpu_blocks_override=12, enable_prompt_embeds=True)
    outs = small.generate([EmbedsPrompt(prompt_embeds=_embed(llm, i)) for i in ids], params,
                          use_tqdm=False)
    assert _tokens(outs) == expected
    assert next(m for m in small.get_metrics() if m.name == "vllm:num_preemptions").value > 0
