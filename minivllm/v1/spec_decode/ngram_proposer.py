"""n-gram (prompt lookup) drafting: reuse what followed an earlier copy of the last few tokens.

Text that quotes its context (summaries, code edits, extraction, repeated structure) repeats
spans of it; where the sequence's last n tokens occurred before, the tokens that followed are a
free guess at what comes next, which the target model then verifies in one step.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.empty(0, dtype=np.int32)


def find_ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` draft tokens for the sequence `tokens` [L].

    Finds the longest suffix of `tokens` (between `min_n` and `max_n` tokens) that also ends
    at an earlier position e < L - 1, the latest such e among the longest, and returns
    `tokens[e + 1 : e + 1 + k]`; empty when no suffix of `min_n` tokens recurs.
    NOTE: vectorised over the candidate positions (those holding the last token), one numpy
    pass per n-gram length, never a loop over tokens.
    """
    length = len(tokens)
    if length < min_n + 1 or k < 1:
        return _EMPTY
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])   # [C] ascending
    if ends.size == 0:
        return _EMPTY
    matched = np.ones(ends.size, dtype=np.int64)     # suffix tokens matched at each candidate
    live = np.ones(ends.size, dtype=bool)            # still matching at this length
    for j in range(1, max_n):
        before = ends - j
        live &= before >= 0
        live[live] = tokens[before[live]] == tokens[length - 1 - j]
        if not live.any():
            break
        matched += live
    best = int(matched.max())
    if best < min_n:
        return _EMPTY
    end = int(ends[np.flatnonzero(matched == best)[-1]])   # the latest of the longest
    return tokens[end + 1:end + 1 + k]


class _History:
    """A request's tokens as a growing int32 array (doubling), synced from the runner's list."""

    def __init__(self) -> None:
        self.buffer = np.empty(256, dtype=np.int32)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        new = token_ids[self.length:]
        end = self.length + len(new)
        if end > len(self.buffer):
            grown = np.empty(max(end, 2 * len(self.buffer)), dtype=np.int32)
            grown[:self.length] = self.buffer[:self.length]
            self.buffer = grown
        self.buffer[self.length:end] = new
        self.length = end
        return self.buffer[:end]


class NgramProposer:
    """vLLM's n-gram proposer: drafts for each request that sampled, from its own tokens."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._histories: dict[str, _History] = {}

    def propose(self, req_ids: list[str], token_ids: list[list[int]]) -> list[list[int]]:
        """Drafts per request, from its prompt and output tokens so far (`token_ids[i]`, which
        only grows while the request runs: each call copies just the new tokens)."""
        drafts = []
        for req_id, ids in zip(req_ids, token_ids):
            history = self._histories.get(req_id)
            if history is None:
                history = self._histories[req_id] = _History()
            tokens = history.sync(ids)
            drafts.append(find_ngram_draft(tokens, self.min_n, self.max_n, self.k).tolist())
        return drafts

    def remove(self, req_ids: set[str]) -> None:
        """Forgets finished and preempted requests (a resumed one starts a new history)."""
        for req_id in req_ids:
            self._histories.pop(req_id, None)
