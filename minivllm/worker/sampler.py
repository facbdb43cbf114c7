"""Batched sampling: grammar bitmask, allowed_token_ids, bad_words, penalties, min_tokens,
logit_bias, temperature, min-p/top-k/top-p, then one draw per row."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minivllm import _custom_ops as ops
from minivllm.sampling_params import SamplingParams, SamplingType
from minivllm.v1.sample.metadata import SamplingMetadata
from minivllm.worker.logits_masks import (allowed_token_mask, apply_grammar_bitmask,
                                          bad_words_context, bad_words_mask_index, ban_tokens,
                                          logit_bias_index, mask_rows, min_tokens_mask_index)

_LogprobEntry = tuple[int, float, int]


@dataclass
class LogprobsTensors:
    """Column 0 is the sampled (or actual next) token, columns 1.. the top-k."""

    logprob_token_ids: torch.Tensor   # [N, k + 1] int64
    logprobs: torch.Tensor            # [N, k + 1] float32
    selected_token_ranks: torch.Tensor  # [N] int64, rank of column 0 (1 = most likely)

    def tolists(self, num_logprobs: list[int | None] | None = None) -> list[list[_LogprobEntry] | None]:
        """Per row: [(token, logprob, rank)] for column 0, then the first `num_logprobs[i]` top
        tokens with ranks 1..k; None for rows that asked for nothing."""
        ids, lps, ranks = (self.logprob_token_ids.tolist(), self.logprobs.tolist(),
                           self.selected_token_ranks.tolist())
        out: list[list[_LogprobEntry] | None] = []
        for i in range(len(ids)):
            k = len(ids[i]) - 1 if num_logprobs is None else num_logprobs[i]
            if k is None:
                out.append(None)
                continue
            row = [(ids[i][0], lps[i][0], ranks[i])]
            row += [(ids[i][j], lps[i][j], j) for j in range(1, k + 1)]
            out.append(row)
        return out


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor            # [B] int64
    logprobs_tensors: LogprobsTensors | None   # raw logprobs of the sampled token and the top-k


@dataclass
class _RequestState:
    params: SamplingParams
    generator: torch.Generator | None
    num_output_tokens: int
    penalty_slot: int | None   # row in the persistent penalty tensors
    # The last output tokens, kept only for requests with multi-token bad_words (their
    # longest word's length - 1 tokens are all the ban needs).
    recent_tokens: list[int] | None = None


def _has_penalties(params: SamplingParams) -> bool:
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0)


class RequestSamplingStates:
    """Sampling state of the requests a runner holds, kept across steps.

    Requests with penalties own a row of two persistent [slots, V] tensors (prompt mask and
    output counts). Appended tokens are queued and scattered in one op per step, so building
    the penalty inputs never walks a token history in Python.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, _RequestState] = {}
        self._free_slots: list[int] = []
        self._num_slots = 0
        self._vocab_size: int | None = None
        self._prompt_mask: torch.Tensor | None = None    # [slots, V] bool
        self._output_counts: torch.Tensor | None = None  # [slots, V] int32
        # Writes waiting for the tensors (whose width is only known at make_metadata).
        self._new_slot_prompts: dict[int, list[int]] = {}
        self._pending_counts: list[tuple[int, int]] = []   # (slot, token_id)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, req_id: str, params: SamplingParams, prompt_token_ids: list[int],
            output_token_ids: list[int]) -> None:
        """Registers a request (or re-registers one resumed after preemption)."""
        generator = None
        if params.sampling_type == SamplingType.RANDOM_SEED:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        slot = None
        if _has_penalties(params):
            slot = self._free_slots.pop() if self._free_slots else self._new_slot()
            self._new_slot_prompts[slot] = list(prompt_token_ids)
            self._pending_counts.extend((slot, t) for t in output_token_ids)
        state = _RequestState(params, generator, len(output_token_ids), slot)
        if any(len(ids) > 1 for ids in params.bad_words_token_ids):
            state.recent_tokens = list(output_token_ids)[-bad_words_context(params):]
        self._states[req_id] = state

    def append(self, req_id: str, token_id: int) -> None:
        state = self._states[req_id]
        state.num_output_tokens += 1
        if state.penalty_slot is not None:
            self._pending_counts.append((state.penalty_slot, token_id))
        if state.recent_tokens is not None:
            state.recent_tokens.append(token_id)
            del state.recent_tokens[:-bad_words_context(state.params)]

    def remove(self, req_id: str) -> None:
        state = self._states.pop(req_id, None)
        if state is not None and state.penalty_slot is not None:
            slot = state.penalty_slot
            self._new_slot_prompts.pop(slot, None)
            self._pending_counts = [(s, t) for s, t in self._pending_counts if s != slot]
            self._free_slots.append(slot)

    def make_metadata(self, req_ids: list[str], vocab_size: int) -> SamplingMetadata:
        """Batch tensors for the logits rows `req_ids` (in that order)."""
        states = [self._states[r] for r in req_ids]
        params = [s.params for s in states]
        types = [p.sampling_type for p in params]
        all_greedy = all(t == SamplingType.GREEDY for t in types)
        all_random = not any(t == SamplingType.GREEDY for t in types)
        num_logprobs = [p.logprobs for p in params]
        asked = [n for n in num_logprobs if n is not None]

        def col(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        temperature = top_p = top_k = min_p = is_greedy = None
        if not all_greedy:
            temperature = col([1.0 if t == SamplingType.GREEDY else p.temperature
                               for p, t in zip(params, types)], torch.float32)
            if not all_random:
                is_greedy = col([t == SamplingType.GREEDY for t in types], torch.bool)
            if any(p.top_p < 1.0 for p in params):
                top_p = col([p.top_p for p in params], torch.float32)
            if any(p.top_k > 0 for p in params):
                top_k = col([p.top_k if 0 < p.top_k < vocab_size else vocab_size
                             for p in params], torch.int64)
            if any(p.min_p > 0.0 for p in params):
                min_p = col([p.min_p for p in params], torch.float32)
        metadata = SamplingMetadata(
            all_greedy=all_greedy, all_random=all_random, is_greedy=is_greedy,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            max_num_logprobs=max(asked) if asked else None, num_logprobs=num_logprobs,
            no_penalties=True, prompt_token_mask=None, output_token_counts=None,
            presence_penalties=None, frequency_penalties=None, repetition_penalties=None,
            min_tokens_mask_index=min_tokens_mask_index(
                [(p, s.num_output_tokens) for p, s in zip(params, states)], vocab_size, self.device),
            logit_bias_index=logit_bias_index(params, self.device),
            allowed_token_mask=allowed_token_mask(params, vocab_size, self.device),
            bad_words_mask_index=bad_words_mask_index(
                [(p.bad_words_token_ids, s.recent_tokens) for p, s in zip(params, states)],
                vocab_size, self.device))
        if any(s.penalty_slot is not None for s in states):
            self._fill_penalties(metadata, states, vocab_size)
        return metadata

    def _fill_penalties(self, metadata: SamplingMetadata, states: list[_RequestState],
                        vocab_size: int) -> None:
        self._flush(vocab_size)
        # Rows without penalties borrow slot 0: their neutral penalties ignore its content.
        slots = torch.tensor([s.penalty_slot or 0 for s in states], device=self.device)
        params = [s.params for s in states]
        metadata.no_penalties = False
        metadata.prompt_token_mask = self._prompt_mask.index_select(0, slots)       # [B, V]
        metadata.output_token_counts = self._output_counts.index_select(0, slots)   # [B, V]
        metadata.presence_penalties = torch.tensor(
            [p.presence_penalty for p in params], dtype=torch.float32, device=self.device)
        metadata.frequency_penalties = torch.tensor(
            [p.frequency_penalty for p in params], dtype=torch.float32, device=self.device)
        metadata.repetition_penalties = torch.tensor(
            [p.repetition_penalty for p in params], dtype=torch.float32, device=self.device)

    def _new_slot(self) -> int:
        self._num_slots += 1
        return self._num_slots - 1

    def _flush(self, vocab_size: int) -> None:
        """Applies queued prompt writes and output-token counts to the persistent tensors."""
        num_rows = max(self._num_slots, 1)
        if self._output_counts is None or self._vocab_size != vocab_size:
            assert self._output_counts is None, "vocab size changed while requests are held"
            self._vocab_size = vocab_size
            self._prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=self.device)
            self._output_counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=self.device)
        elif self._output_counts.shape[0] < num_rows:
            grow = max(num_rows, 2 * self._output_counts.shape[0]) - self._output_counts.shape[0]
            self._prompt_mask = torch.cat([self._prompt_mask, self._prompt_mask.new_zeros(grow, vocab_size)])
            self._output_counts = torch.cat([self._output_counts, self._output_counts.new_zeros(grow, vocab_size)])
        if self._new_slot_prompts:
            new_slots = list(self._new_slot_prompts)
            self._prompt_mask[new_slots] = False
            self._output_counts[new_slots] = 0
            rows = [s for s, toks in self._new_slot_prompts.items() for _ in toks]
            cols = [t for toks in self._new_slot_prompts.values() for t in toks]
            self._prompt_mask[rows, cols] = True
            self._new_slot_prompts.clear()
        if self._pending_counts:
            idx = torch.tensor(self._pending_counts, device=self.device)   # [n, 2] (slot, token)
            ones = torch.ones(idx.shape[0], dtype=torch.int32, device=self.device)
            self._output_counts.index_put_((idx[:, 0], idx[:, 1]), ones, accumulate=True)
            self._pending_counts.clear()


class Sampler(nn.Module):
    """logits [B, V] (any float dtype) -> one token per row (vLLM's v1 order of operations)."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.greedy_bans_only:
            # Greedy with at most -inf bans (grammar, allowed_token_ids, bad_words, min_tokens),
            # which are exact in any float dtype: ban on a copy in the logits' own dtype. Then
            # the argmax of the logits as they are: widening bf16 to fp32 is exact, so this is
            # the fp32 argmax (first index on ties) without a [B, V] fp32 copy; the native
            # kernel for bf16 on CPU, else `max` (~2x faster than `argmax` on CPU).
            if not metadata.plain_greedy:
                logits = _apply_bans(logits.clone(), metadata)
                if metadata.min_tokens_mask_index is not None:
                    logits = ban_tokens(logits, metadata.min_tokens_mask_index)
            tokens = ops.argmax_bf16(logits)
            if tokens is None:
                tokens = logits.max(dim=-1).indices
            return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)
        # A copy even of fp32 logits: the grammar bitmask is applied in place.
        logits = _apply_bans(logits.to(torch.float32, copy=True), metadata)
        # Logprobs are reported from the raw logits, before any processing (vLLM's default).
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)
        if metadata.logitsprocs is not None:   # vLLM's order: custom ones before penalties
            logits = metadata.logitsprocs.apply(logits, argmax_invariant=False)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata.prompt_token_mask,
                                     metadata.output_token_counts, metadata.presence_penalties,
                                     metadata.frequency_penalties, metadata.repetition_penalties)
        if metadata.min_tokens_mask_index is not None:
            logits = ban_tokens(logits, metadata.min_tokens_mask_index)
        if metadata.logit_bias_index is not None:
            rows, token_ids, biases = metadata.logit_bias_index
            logits = logits.index_put((rows, token_ids), biases, accumulate=True)
        sampled = self.sample(logits, metadata)
        logprobs_tensors = None
        if raw_logprobs is not None:
            logprobs_tensors = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None if metadata.all_random else logits.argmax(dim=-1)   # [B]
        if metadata.all_greedy:
            return greedy
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.logitsprocs is not None:   # greedy rows took their argmax above
            logits = metadata.logitsprocs.apply(logits, argmax_invariant=True)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)   # [B, V]
        random = exponential_race(probs, metadata.generators)
        if metadata.all_random:
            return random
        return torch.where(metadata.is_greedy, greedy, random)


def _apply_bans(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The grammar bitmask (in place; as vLLM, before the sampler, so logprobs see it too),
    allowed_token_ids and bad_words."""
    if metadata.grammar_bitmask is not None:
        logits = apply_grammar_bitmask(logits, metadata.grammar_bitmask, metadata.grammar_rows)
    if metadata.allowed_token_mask is not None:
        logits = mask_rows(logits, *metadata.allowed_token_mask)
    if metadata.bad_words_mask_index is not None:
        logits = ban_tokens(logits, metadata.bad_words_mask_index)
    return logits


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """Repetition penalty on prompt and output tokens (divide positive logits, multiply negative
    ones), then frequency (times the count) and presence penalties on output tokens."""
    output_mask = output_counts > 0                              # [B, V]
    rep = repetition.unsqueeze(1)                                # [B, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_mask | output_mask, penalised, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * output_mask


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the top probability."""
    probs = logits.softmax(dim=-1)                               # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keeps the k largest logits per row, then the smallest set reaching probability p."""
    if top_k is None and top_p is None:
        return logits
    # Ascending sort: the kept tokens are a suffix of each row.
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)   # [B, V]
    if top_k is not None:
        kth = logits_sort.gather(1, (logits_sort.shape[1] - top_k).unsqueeze(1))   # [B, 1]
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    if top_p is not None:
        probs_cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)   # [B, V]
        drop = probs_cum <= 1.0 - top_p.unsqueeze(1)
        drop[:, -1] = False   # always keep the most likely token
        logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return logits_sort.scatter(1, logits_idx, logits_sort)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exp(1) draws a token with probability probs (Gumbel-max in
    disguise), with no host sync."""
    q = torch.empty_like(probs).exponential_()
    # NOTE: a loop over seeded rows only: each must draw from its own generator so that its
    # tokens do not depend on which other requests share the batch.
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # exponential_ can return exactly 0, which would make 0 / 0 a NaN on masked tokens.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """logprobs [N, V], token_ids [N] -> the tokens' logprobs and ranks plus the top-k."""
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))   # [N, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1          # [N]
    topk_logprobs, topk_ids = logprobs.topk(num_logprobs, dim=-1)   # [N, k]
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids.unsqueeze(1), topk_ids], dim=1),
        logprobs=torch.cat([token_logprobs, topk_logprobs], dim=1),
        selected_token_ranks=ranks)
