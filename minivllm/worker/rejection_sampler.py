"""Verifying draft tokens: the target samples each draft position; drafts it agrees with stand.

A request with d drafts has d + 1 logits rows: after its last known token and after each draft.
The drafts of n-gram speculation are certain guesses (a draft distribution q that puts all its
mass on one token), and for those, rejection sampling is "sample the target's token x at the
position; accept the draft when x equals it, else keep x and stop": the draft is accepted with
probability p(draft), and a rejected position yields x drawn from p without the draft,
renormalised, which is the residual (p - q)+ the rule asks for. So every token has exactly the
distribution of decoding without drafts, under any sampling settings.

Each position is sampled with the request's sampling state as it would be had the earlier drafts
been generated one by one (penalties' counts, min_tokens, bad_words, the grammar's mask, and a
seeded request's generator, which draws once per sampled token: a seeded request's tokens are
those of decoding without drafts).
"""

from __future__ import annotations

import torch

from minivllm.v1.core.sched.output import GrammarOutput
from minivllm.worker.sampler import RequestSamplingStates, Sampler

LogprobRows = list[list[list[tuple[int, float, int]]] | None]


def verify_drafts(sampler: Sampler, states: RequestSamplingStates, logits: torch.Tensor,
                  req_ids: list[str], drafts: list[list[int]], grammar: GrammarOutput | None
                  ) -> tuple[list[list[int]], LogprobRows | None]:
    """logits [sum(d_i + 1), V], request i's rows together, then its tokens (1 to d_i + 1 per
    request) and, where asked, their logprobs. Appends the tokens to `states`."""
    metadata = states.make_metadata(req_ids, logits.shape[-1])
    if grammar is not None or not metadata.plain_greedy:
        return _by_position(sampler, states, logits, req_ids, drafts, grammar)
    # Plain greedy reads nothing per row from the metadata: one argmax over all R rows.
    tokens = _greedy(sampler(logits, metadata).sampled_token_ids, drafts)
    for req_id, ids in zip(req_ids, tokens):
        for token in ids:
            states.append(req_id, token)
    return tokens, None


def _greedy(argmax: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """Plain greedy requests: from the argmax of every row [R], the accepted prefixes."""
    counts = [len(d) + 1 for d in drafts]
    max_drafts = max(counts) - 1
    starts = torch.tensor(counts).cumsum(0) - torch.tensor(counts)                  # [S]
    index = (starts[:, None] + torch.arange(max_drafts + 1)).clamp_(max=len(argmax) - 1)
    target = argmax[index]                                                    # [S, K + 1]
    draft = torch.tensor([d + [-1] * (max_drafts - len(d)) for d in drafts],
                         dtype=target.dtype).reshape(len(drafts), max_drafts)   # [S, K]
    # Accepted drafts: the leading run of positions where the target's token is the draft's.
    accepted = (target[:, :max_drafts] == draft).to(torch.int32).cumprod(1).sum(1)   # [S]
    return [row[:n + 1] for row, n in zip(target.tolist(), accepted.tolist())]


def _by_position(sampler: Sampler, states: RequestSamplingStates, logits: torch.Tensor,
                 req_ids: list[str], drafts: list[list[int]], grammar: GrammarOutput | None
                 ) -> tuple[list[list[int]], LogprobRows | None]:
    """Position by position over the requests still accepting, each position one sampler call
    on those requests' rows with their state advanced by the drafts before it."""
    counts = [len(d) + 1 for d in drafts]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    mask_rows = _grammar_rows(grammar)
    tokens: list[list[int]] = [[] for _ in req_ids]
    logprobs: list[list | None] = [None] * len(req_ids)
    any_logprobs = False
    alive = list(range(len(req_ids)))
    pos = 0
    while alive:
        ids = [req_ids[i] for i in alive]
        metadata = states.make_metadata(ids, logits.shape[-1])
        rows = [(j, mask_rows[(req_ids[i], pos)]) for j, i in enumerate(alive)
                if (req_ids[i], pos) in mask_rows]
        if rows:
            metadata.grammar_rows = torch.tensor([j for j, _ in rows])
            metadata.grammar_bitmask = torch.from_numpy(grammar.grammar_bitmask[[m for _, m in rows]])
        out = sampler(logits[[starts[i] + pos for i in alive]], metadata)
        step_tokens = out.sampled_token_ids.tolist()
        step_lps = (out.logprobs_tensors.tolists(metadata.num_logprobs)
                    if out.logprobs_tensors is not None else [None] * len(alive))
        next_alive = []
        for i, token, lp in zip(alive, step_tokens, step_lps):
            tokens[i].append(token)
            states.append(req_ids[i], token)   # the next position sees this token
            if lp is not None:
                logprobs[i] = (logprobs[i] or []) + [lp]
                any_logprobs = True
            if pos < len(drafts[i]) and token == drafts[i][pos]:
                next_alive.append(i)
        alive = next_alive
        pos += 1
    return tokens, (logprobs if any_logprobs else None)


def _grammar_rows(grammar: GrammarOutput | None) -> dict[tuple[str, int], int]:
    """(req_id, draft position) -> bitmask row: a request's k-th row is its position k."""
    rows: dict[tuple[str, int], int] = {}
    if grammar is None:
        return rows
    seen: dict[str, int] = {}
    for row, req_id in enumerate(grammar.structured_output_request_ids):
        pos = seen.get(req_id, 0)
        rows[(req_id, pos)] = row
        seen[req_id] = pos + 1
    return rows
