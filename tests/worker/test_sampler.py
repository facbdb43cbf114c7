"""Sampler: greedy, seeded reproducibility, penalties, min_tokens, truncation, logprobs."""

import pytest
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.worker.sampler import RequestSamplingStates, Sampler

V = 32


def sample(params_list, logits, outputs=None, prompts=None):
    states = RequestSamplingStates()
    ids = [f"r{i}" for i in range(len(params_list))]
    for i, (req_id, params) in enumerate(zip(ids, params_list)):
        states.add(req_id, params, (prompts or {}).get(i, [0]), (outputs or {}).get(i, []))
    return Sampler()(logits, states.make_metadata(ids, logits.shape[1])), states


def test_greedy_is_argmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0))
    out, _ = sample([SamplingParams(temperature=0)] * 5, logits)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs_tensors is None


def test_greedy_on_bf16_logits_equals_fp32_argmax_with_ties():
    """The plain-greedy path reads bf16 logits as they are: same token as the fp32 argmax,
    the first index on ties (frequent in bf16); with logprobs it still takes the full path."""
    logits = torch.randint(0, 4, (6, V), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    logits[0, [3, 9, 20]] = 7.0                                  # a three-way tie in row 0
    out, _ = sample([SamplingParams(temperature=0)] * 6, logits)
    assert out.sampled_token_ids[0].item() == 3
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    out, _ = sample([SamplingParams(temperature=0, logprobs=1)] * 6, logits)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs_tensors is not None


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=0),
              SamplingParams(temperature=5.0, seed=1)]
    out, _ = sample(params, logits)
    greedy = logits.argmax(-1)
    assert out.sampled_token_ids[[0, 1, 2]].tolist() == greedy[[0, 1, 2]].tolist()


def draw_seeded(states, req_ids, logits, steps):
    sampler, tokens = Sampler(), []
    for _ in range(steps):
        out = sampler(logits, states.make_metadata(req_ids, V)).sampled_token_ids
        tokens.append(out.tolist())
        for req_id, token in zip(req_ids, out.tolist()):
            states.append(req_id, token)
    return tokens


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = torch.zeros(1, V)   # uniform: every draw depends only on the generator
    alone = RequestSamplingStates()
    alone.add("s", SamplingParams(seed=1234), [0], [])
    solo = [row[0] for row in draw_seeded(alone, ["s"], logits, 8)]
    batch = RequestSamplingStates()
    batch.add("x", SamplingParams(), [0], [])
    batch.add("s", SamplingParams(seed=1234), [0], [])
    batch.add("y", SamplingParams(seed=99), [0], [])
    torch.manual_seed(7)
    mixed = [row[1] for row in draw_seeded(batch, ["x", "s", "y"], logits.expand(3, V), 8)]
    assert solo == mixed
    other = RequestSamplingStates()
    other.add("s", SamplingParams(seed=4321), [0], [])
    assert [row[0] for row in draw_seeded(other, ["s"], logits, 8)] != solo


def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    ref = logits.clone()
    for token in set(prompt) | set(output):
        ref[token] = ref[token] / repetition if ref[token] > 0 else ref[token] * repetition
    for token in set(output):
        ref[token] -= frequency * output.count(token) + presence
    return ref


def test_penalties_match_the_reference_formula():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2)) * 3
    prompts = {0: [1, 2, 3, 3], 1: [5]}
    outputs = {0: [3, 4, 4, 9], 1: [6, 6, 6]}
    params = [dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
              dict(presence_penalty=-0.2, frequency_penalty=1.0, repetition_penalty=0.8)]
    states = RequestSamplingStates()
    for i, p in enumerate(params):
        states.add(f"r{i}", SamplingParams(temperature=0, **p), prompts[i], outputs[i][:2])
        for token in outputs[i][2:]:
            states.append(f"r{i}", token)   # queued appends are counted like initial tokens
    meta = states.make_metadata(["r0", "r1"], V)
    from minivllm.worker.sampler import apply_penalties
    got = apply_penalties(logits, meta.prompt_token_mask, meta.output_token_counts,
                          meta.presence_penalties, meta.frequency_penalties,
                          meta.repetition_penalties)
    for i, p in enumerate(params):
        want = reference_penalties(logits[i], prompts[i], outputs[i], p["presence_penalty"],
                                   p["frequency_penalty"], p["repetition_penalty"])
        torch.testing.assert_close(got[i], want)


def test_penalty_slots_are_reused_cleanly():
    states = RequestSamplingStates()
    states.add("a", SamplingParams(frequency_penalty=1.0), [1], [2, 2])
    states.make_metadata(["a"], V)
    states.remove("a")
    states.add("b", SamplingParams(frequency_penalty=1.0), [3], [])
    states.add("c", SamplingParams(), [4], [])
    meta = states.make_metadata(["c", "b"], V)
    assert meta.output_token_counts[1].sum() == 0
    assert meta.prompt_token_mask[1].nonzero().flatten().tolist() == [3]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(2, V)
    logits[:, 5] = 100.0   # eos
    logits[:, 6] = 50.0    # stop id
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6])
    params.update_from_eos_token_id(5)
    states = RequestSamplingStates()
    states.add("early", params, [0], [3])
    states.add("done", params, [0], [3, 3])
    out = Sampler()(logits, states.make_metadata(["early", "done"], V))
    assert out.sampled_token_ids.tolist()[1] == 5
    assert out.sampled_token_ids.tolist()[0] not in (5, 6)


def allowed_tokens(params, logits, draws=3000):
    out, _ = sample([params] * draws, logits.expand(draws, V))
    return set(out.sampled_token_ids.tolist())


@pytest.fixture
def probs_logits():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04] + [0.0] * (V - 6))
    return probs.clamp_min(1e-12).log().unsqueeze(0)


def test_top_k_top_p_min_p_keep_only_allowed_tokens(probs_logits):
    torch.manual_seed(0)
    assert allowed_tokens(SamplingParams(top_k=3), probs_logits) == {0, 1, 2}
    assert allowed_tokens(SamplingParams(top_p=0.7), probs_logits) == {0, 1, 2}
    assert allowed_tokens(SamplingParams(min_p=0.3), probs_logits) == {0, 1, 2}
    assert allowed_tokens(SamplingParams(top_k=4, top_p=0.5), probs_logits) == {0, 1}
    assert allowed_tokens(SamplingParams(), probs_logits) == set(range(6))


def test_random_sampling_follows_the_distribution(probs_logits):
    torch.manual_seed(1)
    draws = 20000
    out, _ = sample([SamplingParams()] * draws, probs_logits.expand(draws, V))
    freq = torch.bincount(out.sampled_token_ids, minlength=V)[:6].float() / draws
    torch.testing.assert_close(freq, probs_logits.exp()[0, :6], atol=0.015, rtol=0)


def test_logprobs_ranks_and_topk(probs_logits):
    logits = torch.cat([probs_logits, probs_logits.flip(-1)])
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(logprobs=0, top_k=1)]
    out, _ = sample(params, logits)
    lt = out.logprobs_tensors
    raw = logits.log_softmax(-1)
    assert lt.logprob_token_ids.shape == (2, 3)
    rows = lt.tolists([2, 0])
    assert rows[0][0][0] == 0 and rows[0][0][2] == 1
    assert [(t, r) for t, _, r in rows[0][1:]] == [(0, 1), (1, 2)]
    assert rows[0][2][1] == pytest.approx(raw[0, 1].item())
    assert len(rows[1]) == 1 and rows[1][0][0] == V - 1 and rows[1][0][2] == 1
    # A sampled token that is not the most likely one gets its true rank.
    meta_states = RequestSamplingStates()
    meta_states.add("p", SamplingParams(logprobs=1, temperature=0, repetition_penalty=2.0), [0], [])
    out = Sampler()(probs_logits, meta_states.make_metadata(["p"], V))
    (row,) = out.logprobs_tensors.tolists([1])
    assert row[0][0] == 1 and row[0][2] == 2
    assert row[0][1] == pytest.approx(probs_logits.log_softmax(-1)[0, 1].item())
