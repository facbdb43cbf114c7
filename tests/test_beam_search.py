"""The beam score: vLLM's length-normalised logprob, finite for any finite length_penalty."""

import math

import pytest

from minivllm.beam_search import get_beam_search_score


def test_score_is_the_length_normalised_logprob_without_a_final_eos():
    assert get_beam_search_score([5, 6, 7, 8], -2.0, eos_token_id=1) == pytest.approx(-0.5)
    assert get_beam_search_score([5, 6, 7, 1], -3.0, eos_token_id=1,
                                 length_penalty=2.0) == pytest.approx(-3.0 / 9)


@pytest.mark.parametrize("penalty", [1e308, -1e308, 800.0, -800.0])
def test_extreme_length_penalties_rank_beams_instead_of_failing(penalty):
    """length ** 1e308 overflows a float (a server once answered such a request with a 500)."""
    scores = [get_beam_search_score(list(range(n)), -1.0 * n, None, penalty) for n in (3, 5)]
    assert all(math.isfinite(s) and s <= 0 for s in scores)
