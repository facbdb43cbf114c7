"""Reasoning written between a start and an end tag (`<think>` ... `</think>`), each one token
of the vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from minivllm.reasoning.abs_reasoning_parsers import ReasoningParser
from minivllm.utils.text_utils import held_back


class BaseThinkingReasoningParser(ReasoningParser):
    """`start_token` ... `end_token` around the reasoning. `assume_reasoning`: with neither tag
    in the prompt, the model is taken to start inside its reasoning (DeepSeek-R1's templates
    open it for the model); otherwise only a start tag, in the prompt or output, opens it."""

    start_token = "<think>"
    end_token = "</think>"
    assume_reasoning = False

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        missing = [t for t in (self.start_token, self.end_token) if t not in vocab]
        if missing:
            raise ValueError(f"The {type(self).__name__} needs {' and '.join(missing)} as tokens "
                             "of the model's vocabulary; this tokenizer has no such token. Is "
                             "the model a reasoning model of this family?")
        self.reasoning_start_token_id = vocab[self.start_token]
        self.reasoning_end_token_id = vocab[self.end_token]

    def _last(self, ids: Sequence[int], token_id: int) -> int:
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] == token_id:
                return i
        return -1

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        start = self._last(prompt_token_ids, self.reasoning_start_token_id)
        end = self._last(prompt_token_ids, self.reasoning_end_token_id)
        if start < 0 and end < 0:
            return self.assume_reasoning
        return start > end

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        end = self._last(input_ids, self.reasoning_end_token_id)
        return end >= 0 and end > self._last(input_ids, self.reasoning_start_token_id)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The ids after the reasoning's end ([] while it has not ended)."""
        end = self._last(input_ids, self.reasoning_end_token_id)
        return input_ids[end + 1:] if end >= 0 else []

    def parse(self, text: str, final: bool, in_reasoning: bool = False) -> tuple[str, str]:
        start, end = self.start_token, self.end_token
        if not in_reasoning:
            if text.startswith(start):
                text, in_reasoning = text[len(start):], True
            elif not final and start.startswith(text):
                return "", ""          # may still become the start tag
        if not in_reasoning:
            return "", text
        if text.startswith(start):     # a template that opened it, and a model that opens it again
            text = text[len(start):]
        reasoning, found, content = text.partition(end)
        if found:
            return reasoning, content
        if not final:                  # hold back what may still become the end tag
            reasoning = reasoning[:len(reasoning) - held_back(reasoning, end)]
        return reasoning, ""

