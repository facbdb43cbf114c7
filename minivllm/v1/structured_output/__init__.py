"""Structured outputs (vLLM's `v1/structured_output`): grammars compiled off the engine loop,
cached by constraint, and one token bitmask per step for the constrained rows that sample."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import numpy as np
import torch

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.v1.core.sched.output import GrammarOutput
from minivllm.v1.structured_output.backend_guidance import (fill_bitmask, grammar_key,
                                                            make_ll_tokenizer, serialize_grammar)
from minivllm.v1.structured_output.request import StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest", "validate_structured_outputs"]

_CACHE_SIZE = 256   # compiled grammars kept (each is a matcher in its initial state)


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raises ValueError naming the problem (bad JSON, bad regex, unknown grammar rule...)."""
    serialize_grammar(params)


class StructuredOutputManager:
    """Compiles grammars in a thread pool (so one slow schema does not stall the engine loop)
    and fills the per-step bitmask. Nothing is built until the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_workers: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        num_threads = max_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="minivllm-grammar")
        self._num_threads = num_threads
        self._lock = threading.Lock()             # the cache (engine thread and handlers)
        self._tokenizer_lock = threading.Lock()   # the one-time tokenizer conversion
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[str, Future] = OrderedDict()

    def grammar_init(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Starts (or reuses) the compilation of `params`; validates it first (ValueError)."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer.")
        grammar = serialize_grammar(params)
        key = grammar_key(params)
        with self._lock:
            future = self._compiled.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, grammar)
                self._compiled[key] = future
                while len(self._compiled) > _CACHE_SIZE:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
        return StructuredOutputRequest(params, future)

    def grammar_bitmask(self, requests: list[Any],
                        spec_tokens: dict[str, list[int]] | None = None) -> GrammarOutput | None:
        """The bitmask rows of the requests (with a ready grammar) that sample this step.

        A request with draft tokens samples at each draft position too: position p's row is the
        mask after its first p drafts, which are accepted here for the mask and rolled back
        (the drafts were validated against the grammar when they were proposed). Rows go
        position by position, each position's rows filled in one call.
        """
        constrained = [r for r in requests if r.structured_output_request is not None
                       and r.structured_output_request.reasoning_ended]
        if not constrained:
            return None
        spec_tokens = spec_tokens or {}
        drafts = [spec_tokens.get(r.request_id, []) for r in constrained]
        grammars = [r.structured_output_request.grammar for r in constrained]
        width = (self.vocab_size + 31) // 32
        ids: list[str] = []
        blocks: list[np.ndarray] = []
        for pos in range(max(len(d) for d in drafts) + 1):
            rows = [i for i, d in enumerate(drafts) if len(d) >= pos]
            block = np.empty((len(rows), width), dtype=np.int32)
            if pos:
                for i in rows:
                    grammars[i].accept_tokens(constrained[i].request_id, [drafts[i][pos - 1]])
            fill_bitmask(self._get_executor(), [grammars[i] for i in rows],
                         torch.from_numpy(block))   # shares memory
            ids += [constrained[i].request_id for i in rows]
            blocks.append(block)
        for grammar, d in zip(grammars, drafts):
            if d:
                grammar.rollback(len(d))
        bitmask = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        return GrammarOutput(structured_output_request_ids=ids, grammar_bitmask=bitmask)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._get_ll_tokenizer(), grammar)
        if matcher.is_error():
            raise ValueError(f"Invalid structured output grammar: {matcher.get_error()}")
        return matcher

    def _get_ll_tokenizer(self) -> llguidance.LLTokenizer:
        # NOTE: built once, in a pool thread: it takes ~0.7 s for a 49k-token vocabulary.
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = make_ll_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll_tokenizer

    def _get_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._num_threads)
        return self._executor
