"""The n-gram proposer against a brute-force reading of its rule, and its incremental history."""

import numpy as np
import pytest

from minivllm.v1.spec_decode.ngram_proposer import NgramProposer, find_ngram_draft


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule spelled out: longest n first, and for it the latest earlier end position."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_matches_the_brute_force_rule_on_random_sequences(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(400):
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        got = find_ngram_draft(np.array(tokens, dtype=np.int32), min_n, max_n, k).tolist()
        assert got == _reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_prefers_the_longest_match_then_the_latest():
    tokens = [1, 2, 3, 9, 7, 3, 8, 2, 3]
    # suffix "2 3" occurs at 1..2 (followed by 9 7); suffix "3" alone also at 5 (followed by 8)
    assert find_ngram_draft(np.array(tokens, dtype=np.int32), 1, 3, 2).tolist() == [9, 7]
    # with max_n=1 only the last token matters: its latest earlier occurrence is position 5
    assert find_ngram_draft(np.array(tokens, dtype=np.int32), 1, 1, 2).tolist() == [8, 2]
    # min_n=3: "8 2 3" never occurred before, so no draft
    assert find_ngram_draft(np.array(tokens, dtype=np.int32), 3, 3, 2).tolist() == []


def test_proposer_keeps_each_history_and_forgets_finished_ones():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2)
    a = [5, 6, 7, 8, 5]
    b = [1, 1, 1]
    assert proposer.propose(["a", "b"], [a, b]) == [[], [1]]
    a += [6]   # the runner's list grows; the proposer copies only the new token
    assert proposer.propose(["a"], [a]) == [[7, 8, 5]]
    assert proposer._histories["a"].length == 6
    long = list(range(300)) + [0, 1]   # grows the buffer past its first 256 slots
    assert proposer.propose(["c"], [long]) == [[2, 3, 4]]
    proposer.remove({"a", "c"})
    assert set(proposer._histories) == {"b"}
