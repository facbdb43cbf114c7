"""Incremental detokenisation of one sequence, with stop strings and streaming hold-back."""

from __future__ import annotations

from typing import Any

from minivllm.sampling_params import SamplingParams
from minivllm.utils.text_utils import held_back

# Prompt tokens decoded as left context of the first output token: enough for tokenizers whose
# token strings depend on their neighbours (SentencePiece's leading-space marker).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


class IncrementalDetokenizer:
    """Turns generated token ids into text one step at a time.

    Works on token strings: each step decodes `tokens[prefix_offset:]` and emits what grew past
    the decode of `tokens[prefix_offset:read_offset]`. Text ending in U+FFFD (a UTF-8 character
    split across byte-level tokens) is held back until the next tokens complete it.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        context = prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET - 1:]
        self.tokens: list[str] = self._to_tokens(context)
        self.prefix_offset = max(len(self.tokens) - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self.read_offset = len(self.tokens)
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_string: str | None = None
        self._num_sent_chars = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decodes `new_token_ids`; returns the stop string they completed, if any.

        After a stop string matches, `output_text` is truncated at it (or right after it with
        include_stop_str_in_output) and further updates are ignored.
        """
        if self.stop_string is not None:
            return self.stop_string
        num_chars_before = len(self.output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.output_text += self._decode_next(token_id)
        if self.stop and len(self.token_ids) >= self.min_tokens:
            new_char_count = len(self.output_text) - num_chars_before
            self.stop_string = self._check_stop_strings(new_char_count)
        return self.stop_string

    def get_output_text(self, finished: bool = False) -> str:
        """Text safe to show so far: all of it when finished, else without the held-back tail."""
        if finished or self.stop_string is not None:
            return self.output_text
        return self.output_text[:len(self.output_text) - self._num_held_back_chars()]

    def get_delta_text(self, finished: bool = False) -> str:
        """Text not returned by earlier calls (streaming)."""
        text = self.get_output_text(finished)
        delta = text[self._num_sent_chars:]
        self._num_sent_chars = max(self._num_sent_chars, len(text))
        return delta

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        tokens = self.tokenizer.convert_ids_to_tokens(
            token_ids, skip_special_tokens=self.skip_special_tokens)
        return [t for t in tokens if t is not None]

    def _decode_next(self, token_id: int) -> str:
        self.tokens.extend(self._to_tokens([token_id]))
        convert = self.tokenizer.convert_tokens_to_string
        prefix_text = convert(self.tokens[self.prefix_offset:self.read_offset])
        new_text = convert(self.tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            # A skipped special token, or a partial UTF-8 character: nothing to emit yet.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return new_text[len(prefix_text):]

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        """Looks for a stop string overlapping the new text and truncates the output there."""
        if new_char_count == 0:
            return None
        text = self.output_text
        best: tuple[int, str] | None = None   # earliest match wins
        for stop_str in self.stop:
            # Only the new text and the len(stop_str) - 1 characters before it can hold a match
            # that was not already checked.
            start = max(len(text) - new_char_count - len(stop_str) + 1, 0)
            index = text.find(stop_str, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        if best is None:
            return None
        index, stop_str = best
        if self.include_stop_str_in_output:
            index += len(stop_str)
        self.output_text = text[:index]
        return stop_str

    def _num_held_back_chars(self) -> int:
        """Length of the longest tail of the text that may still grow into a stop string."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(held_back(self.output_text, stop_str) for stop_str in self.stop)
