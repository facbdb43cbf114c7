"""Sampler: the grammar bitmask (constrained rows only, one op), logit_bias, allowed_token_ids."""

import pytest
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.worker.logits_masks import apply_grammar_bitmask
from minivllm.worker.sampler import RequestSamplingStates, Sampler

V = 70   # not a multiple of 32: the last bitmask word is partly past the vocabulary


def _metadata(params_list):
    states = RequestSamplingStates()
    ids = [f"r{i}" for i in range(len(params_list))]
    for req_id, params in zip(ids, params_list):
        states.add(req_id, params, [0], [])
    return states.make_metadata(ids, V)


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[C, V] bool -> [C, ceil(V / 32)] int32 words, bit t of word w = token 32 w + t."""
    words = torch.zeros(allowed.shape[0], (allowed.shape[1] + 31) // 32, dtype=torch.int64)
    for row, col in allowed.nonzero().tolist():
        words[row, col // 32] |= 1 << (col % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_bitmask_masks_only_the_constrained_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=gen)
    allowed = torch.rand(2, V, generator=gen) < 0.3
    allowed[:, 31] = allowed[:, 63] = True   # bit 31: the int32 sign bit
    rows = torch.tensor([3, 1])
    out = apply_grammar_bitmask(logits, _pack(allowed), rows)
    expected = logits.clone()
    expected[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    assert torch.equal(out, expected)


def test_sampler_draws_only_allowed_tokens_beside_free_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=gen) * 5
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, [5, 40, 69]] = True
    metadata = _metadata([SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
                          SamplingParams(temperature=0)])
    metadata.grammar_bitmask, metadata.grammar_rows = _pack(allowed), torch.tensor([1])
    for _ in range(20):
        tokens = Sampler()(logits, metadata).sampled_token_ids.tolist()
        assert tokens[1] in (5, 40, 69)
        assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    # Greedy rows under a grammar take the best allowed token.
    metadata = _metadata([SamplingParams(temperature=0)])
    metadata.grammar_bitmask, metadata.grammar_rows = _pack(allowed), torch.tensor([0])
    best = max((5, 40, 69), key=lambda t: logits[0, t])
    assert Sampler()(logits[:1], metadata).sampled_token_ids.item() == best


def test_logit_bias_bans_and_forces():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    top = int(logits[0].argmax())
    params = [SamplingParams(temperature=0, logit_bias={top: -100}),
              SamplingParams(temperature=1.0, logit_bias={7: 100}),
              SamplingParams(temperature=0)]
    for _ in range(10):
        tokens = Sampler()(logits, _metadata(params)).sampled_token_ids.tolist()
        assert tokens[0] != top and tokens[0] == int(logits[0].topk(2).indices[1])
        assert tokens[1] == 7
        assert tokens[2] == int(logits[2].argmax())


def test_logit_bias_is_validated():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="out of range"):
        SamplingParams(logit_bias={V: 1.0}).verify_vocab(V)
    assert SamplingParams(logit_bias={"3": 2}).logit_bias == {3: 2.0}


def test_allowed_token_ids_restrict_only_their_row():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0, allowed_token_ids=[3, 65]), SamplingParams(temperature=0)]
    for _ in range(10):
        tokens = Sampler()(logits, _metadata(params)).sampled_token_ids.tolist()
        assert tokens[0] in (3, 65) and tokens[1] == int(logits[1].argmax())
    with pytest.raises(ValueError, match="allowed_token_ids token id 70"):
        SamplingParams(allowed_token_ids=[70]).verify_vocab(V)


def test_greedy_bans_on_bf16_logits_match_the_fp32_path():
    """Greedy rows with only -inf bans (grammar, allowed_token_ids, min_tokens) are banned in
    bf16 and take the bf16 argmax: the same tokens as banning fp32 logits; the input is kept."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=gen).to(torch.bfloat16)
    before = logits.clone()
    allowed = torch.rand(2, V, generator=gen) < 0.2
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, allowed_token_ids=[1, 2, 69]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7])]
    metadata = _metadata(params)
    metadata.grammar_bitmask, metadata.grammar_rows = _pack(allowed), torch.tensor([2, 0])
    assert metadata.greedy_bans_only and not metadata.plain_greedy
    tokens = Sampler()(logits, metadata).sampled_token_ids.tolist()
    expected = logits.float()
    expected[[2, 0]] = expected[[2, 0]].masked_fill(~allowed, float("-inf"))
    expected[1, [t for t in range(V) if t not in (1, 2, 69)]] = float("-inf")
    expected[2, 7] = float("-inf")
    assert tokens == expected.argmax(-1).tolist() and torch.equal(logits, before)
