"""Draft verification: accepted prefixes, the target's distribution kept exactly, seeded
requests unchanged by drafting, per-position sampling state."""

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.v1.core.sched.output import GrammarOutput
from minivllm.worker.rejection_sampler import verify_drafts
from minivllm.worker.sampler import RequestSamplingStates, Sampler

V = 8


def _states(params: list[SamplingParams]) -> tuple[RequestSamplingStates, list[str]]:
    states = RequestSamplingStates()
    ids = [f"r{i}" for i in range(len(params))]
    for req_id, p in zip(ids, params):
        states.add(req_id, p, [0], [])
    return states, ids


def _peaked(tokens: list[int]) -> torch.Tensor:
    """One logits row per token, whose argmax is that token."""
    logits = torch.zeros(len(tokens), V)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_accepts_the_leading_run_of_agreeing_drafts():
    states, ids = _states([SamplingParams(temperature=0)] * 3)
    # r0: drafts 1 2 3, target says 1 2 5 6 -> accepts 1 2, then its own 5
    # r1: drafts 4, target says 7 ... -> no draft accepted, its own 7
    # r2: drafts 3 3, target says 3 3 2 -> both accepted plus the bonus token 2
    logits = _peaked([1, 2, 5, 6] + [7, 0] + [3, 3, 2])
    tokens, logprobs = verify_drafts(Sampler(), states, logits, ids, [[1, 2, 3], [4], [3, 3]], None)
    assert tokens == [[1, 2, 5], [7], [3, 3, 2]] and logprobs is None
    assert [states._states[r].num_output_tokens for r in ids] == [3, 1, 3]


def test_each_position_sees_the_drafts_before_it():
    """min_tokens=2 bans the stop token 2 until two tokens exist: at the draft positions the
    accepted drafts count, so position 2 may stop and positions 0 and 1 may not."""
    states, ids = _states([SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2],
                                          logprobs=1)])
    logits = _peaked([2, 2, 2])
    logits[[0, 1, 2], [4, 5, 6]] = 3.0           # each row's second best
    tokens, logprobs = verify_drafts(Sampler(), states, logits, ids, [[4, 5]], None)
    assert tokens == [[4, 5, 2]]
    assert [entries[0][0] for entries in logprobs[0]] == [4, 5, 2]


def test_seeded_requests_draw_the_tokens_of_decoding_without_drafts():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    params = SamplingParams(temperature=1.0, seed=1234)
    plain_states, plain_ids = _states([params])
    plain = []
    for row in range(4):
        token = Sampler()(logits[row:row + 1], plain_states.make_metadata(plain_ids, V))
        plain.append(token.sampled_token_ids.item())
        plain_states.append("r0", plain[-1])
    # Drafting exactly the tokens decoding would pick: all accepted, the same tokens.
    states, ids = _states([params])
    tokens, _ = verify_drafts(Sampler(), states, logits, ids, [plain[:3]], None)
    assert tokens == [plain]


def test_accepted_and_corrected_tokens_follow_the_target_distribution():
    """4,000 requests with the same draft: the first token is distributed as p0 and, when the
    draft was accepted, the second as p1 (exact rejection sampling for a certain draft)."""
    n = 4000
    states, ids = _states([SamplingParams(temperature=1.0)] * n)
    p0 = torch.tensor([0.1, 0.5, 0.2, 0.2, 0, 0, 0, 0])
    p1 = torch.tensor([0.25, 0.25, 0.0, 0.5, 0, 0, 0, 0])
    rows = torch.stack([p0, p1]).clamp_min(1e-12).log().repeat(n, 1)   # [2n, V]
    torch.manual_seed(0)
    tokens, _ = verify_drafts(Sampler(), states, rows, ids, [[1]] * n, None)
    first = np.bincount([t[0] for t in tokens], minlength=V) / n
    assert np.abs(first - p0.numpy()).max() < 4 * np.sqrt(0.25 / n)
    accepted = [t for t in tokens if t[0] == 1]
    assert all(len(t) == 2 for t in accepted) and all(len(t) == 1 for t in tokens if t[0] != 1)
    second = np.bincount([t[1] for t in accepted], minlength=V) / len(accepted)
    assert np.abs(second - p1.numpy()).max() < 4 * np.sqrt(0.25 / len(accepted))


def test_grammar_rows_apply_per_draft_position():
    states, ids = _states([SamplingParams(temperature=0)])
    logits = _peaked([1, 1, 1])
    # position 0 allows only token 1; position 1 only token 6; position 2 anything.
    masks = np.zeros((3, 1), dtype=np.int32)
    masks[0, 0], masks[1, 0], masks[2, 0] = 1 << 1, 1 << 6, (1 << V) - 1
    grammar = GrammarOutput(structured_output_request_ids=["r0"] * 3, grammar_bitmask=masks)
    tokens, _ = verify_drafts(Sampler(), states, logits, ids, [[1, 5]], grammar)
    assert tokens == [[1, 6]]   # draft 1 accepted, draft 5 replaced by the only allowed token
