"""LLM.beam_search against the same search run on transformers' fp32 logits: the same beams,
tokens and cumulative logprobs, eos-ended beams complete (and ranked by vLLM's length-normalised
score), width 1 is greedy decoding, and bad parameters are ValueErrors."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.beam_search import get_beam_search_score
from minivllm.sampling_params import BeamSearchParams
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

PROMPTS = ["The quick brown fox", "Hello world, how"]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("beam_ckpt")))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=path, dtype="float32", max_model_len=128, num_gpu_blocks_override=128)


def _reference(model, prompt_ids, width, steps, eos, length_penalty=1.0):
    """The search on transformers' logits: [(tokens, cum_logprob)] best first."""
    def score(beam):
        return get_beam_search_score(beam[0], beam[1], eos, length_penalty)
    live, done = [(list(prompt_ids), 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t == eos else grown).append((tokens + [t], cum + lp))
        live = sorted(grown, key=score, reverse=True)[:width]
        if not live:
            break
    return sorted(done + live, key=score, reverse=True)[:width]


def _check(llm, model, params, eos):
    outputs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        ids = llm.llm_engine.tokenize_prompt(prompt)
        expected = _reference(model, ids, params.beam_width, params.max_tokens, eos,
                              params.length_penalty)
        assert [s.tokens for s in out.sequences] == [t for t, _ in expected]
        for seq, (_, cum) in zip(out.sequences, expected):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)
            assert len(seq.logprobs) == len(seq.tokens) - len(ids)
            assert seq.finish_reason == ("stop" if seq.tokens[-1] == eos else "length")
    return outputs


def test_beams_match_the_search_on_transformers_logits(llm, path):
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    _check(llm, model, BeamSearchParams(beam_width=3, max_tokens=6), llm.llm_engine.eos_token_id)
    # eos made a token the search meets (the greedy second token): beams end there, complete
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2),
                          use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    saved, engine.eos_token_id = engine.eos_token_id, greedy[1]
    try:
        short = _check(llm, model, BeamSearchParams(beam_width=3, max_tokens=6,
                                                    length_penalty=0.5), greedy[1])
        # length_penalty 2: the long beams outrank the complete short ones (raw cum_logprob
        # would rank those first)
        long = _check(llm, model, BeamSearchParams(beam_width=3, max_tokens=6,
                                                   length_penalty=2.0), greedy[1])
    finally:
        engine.eos_token_id = saved
    assert any(s.finish_reason == "stop" for s in short[0].sequences)
    assert all(s.finish_reason == "length" for s in long[0].sequences)
    assert max(s.cum_logprob for s in short[0].sequences) > long[0].sequences[0].cum_logprob


def test_width_one_is_greedy(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for prompt in PROMPTS:
        greedy = llm.generate(prompt, params, use_tqdm=False)[0]
        [beam] = llm.beam_search(prompt, BeamSearchParams(beam_width=1, max_tokens=8,
                                                           ignore_eos=True))[0].sequences
        assert beam.tokens == greedy.prompt_token_ids + list(greedy.outputs[0].token_ids)


def test_concurrency_limit_and_errors(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    together = llm.beam_search(PROMPTS, params)
    one_by_one = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in together] == \
        [[s.tokens for s in o.sequences] for o in one_by_one]
    with pytest.raises(ValueError, match="beam_width must be at most 10"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="Prompt 1 has 5 tokens: with max_tokens=125 its beams "
                                         "would pass max_model_len=128"):
        llm.beam_search([PROMPTS[0], [7] * 5], BeamSearchParams(beam_width=2, max_tokens=125))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams())
    assert not llm.llm_engine.has_unfinished_requests()
