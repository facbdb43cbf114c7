"""bad_words: tokenised with and without a leading space, one-token words always banned, longer
words banned only when the output so far ends with the rest of the word."""

import pytest
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.worker.logits_masks import bad_words_bans
from minivllm.worker.sampler import RequestSamplingStates, Sampler

V = 16


class _WordTokenizer:
    """encode: a fixed table of texts -> ids ("ab" is two tokens, " ab" another two)."""

    TABLE = {"x": [3], " x": [4], "ab": [5, 6], " ab": [7, 6], "yz": [8, 9], " yz": [8, 9, 10]}

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return self.TABLE[text]


def _params(*words, **kwargs) -> SamplingParams:
    params = SamplingParams(temperature=0.0, bad_words=list(words), **kwargs)
    params.update_from_tokenizer(_WordTokenizer())
    return params


def test_words_tokenised_bare_and_with_a_leading_space():
    # " x" is another single token: both kept. " ab" starts with another token and has the same
    # length: kept. " yz" has another length: dropped (vLLM's rule).
    assert _params("x").bad_words_token_ids == [[3], [4]]
    assert _params("  ab").bad_words_token_ids == [[5, 6], [7, 6]]
    assert _params("yz").bad_words_token_ids == [[8, 9]]
    assert SamplingParams(bad_words=["x"]).bad_words_token_ids == []   # until the engine's call
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ok", "  "])
    with pytest.raises(ValueError, match="tokenizer"):
        SamplingParams(bad_words=["x"]).update_from_tokenizer(None)


def test_bans_follow_the_output_tail():
    words = [[3], [5, 6], [1, 2, 9]]
    assert bad_words_bans(words, None, V) == [3]
    assert bad_words_bans(words, [0, 5], V) == [3, 6]
    assert bad_words_bans(words, [5, 0], V) == [3]
    assert bad_words_bans(words, [1, 2], V) == [3, 9]
    assert bad_words_bans([[3], [40]], None, V) == [3]   # past the vocabulary: nothing to mask


def _step(states, req_ids, logits):
    return Sampler()(logits, states.make_metadata(req_ids, V)).sampled_token_ids.tolist()


def test_sampler_bans_in_one_batch_and_tracks_the_output():
    """Row 0 bans "x" (3 and 4) always and "ab" after 5; row 1 has no bad words. Both rows'
    logits prefer 3, then 4, then 6: row 0 must fall through to 6 only while 5 ends its output."""
    logits = torch.zeros(2, V)
    logits[:, 3], logits[:, 4], logits[:, 6], logits[:, 11] = 9.0, 8.0, 7.0, 6.0
    states = RequestSamplingStates()
    states.add("a", _params("x", "ab"), prompt_token_ids=[5], output_token_ids=[])
    states.add("b", SamplingParams(temperature=0.0), prompt_token_ids=[5], output_token_ids=[])
    # The prompt's trailing 5 does not count: 6 is allowed on the first step.
    assert _step(states, ["a", "b"], logits) == [6, 3]
    states.append("a", 5)
    states.append("b", 3)
    assert _step(states, ["a", "b"], logits) == [11, 3]
    states.append("a", 1)
    assert _step(states, ["a"], logits[:1]) == [6]


def test_resumed_request_keeps_its_tail():
    """A request re-registered after preemption rebuilds the tail from its output tokens."""
    logits = torch.zeros(1, V)
    logits[0, 6], logits[0, 2] = 5.0, 1.0
    states = RequestSamplingStates()
    states.add("a", _params("ab", seed=0), prompt_token_ids=[0], output_token_ids=[1, 1, 5])
    assert _step(states, ["a"], logits) == [2]
