"""vLLM's reasoning-parser contract: a reasoning model's text -> (reasoning, content), and the
registry behind `--reasoning-parser NAME`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class ReasoningParser:
    """Splits what a reasoning model writes into its reasoning and its answer (content).

    `parse(text, final, in_reasoning)` is called on the whole text so far: while `final` is
    False, neither part ends in something that may still become a tag, so a stream can send
    both parts as they grow. `in_reasoning`: the prompt left the model thinking
    (`starts_in_reasoning`). The engine uses `is_reasoning_end` and `reasoning_end_token_id` to
    hold a structured-output grammar back until the reasoning is over.
    """

    reasoning_end_token_id: int | None = None

    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer

    def parse(self, text: str, final: bool, in_reasoning: bool = False) -> tuple[str, str]:
        raise NotImplementedError

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the model's first token continues a reasoning block the prompt opened."""
        raise NotImplementedError

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether `input_ids` (a prompt, or prompt + output) closed its reasoning."""
        raise NotImplementedError

    def extract_reasoning(self, model_output: str, request: Any = None
                          ) -> tuple[str | None, str | None]:
        """vLLM's whole-output split: (reasoning or None, content or None)."""
        reasoning, content = self.parse(model_output, final=True,
                                        in_reasoning=self.starts_in_reasoning(()))
        return reasoning or None, content or None


class ReasoningParserManager:
    """`--reasoning-parser` names -> parser classes (vLLM's registry, same names)."""

    reasoning_parsers: dict[str, type[ReasoningParser]] = {}

    @classmethod
    def register_module(cls, name: str | list[str]) -> Callable[[type], type]:
        def register(parser_cls: type) -> type:
            for alias in [name] if isinstance(name, str) else name:
                cls.reasoning_parsers[alias] = parser_cls
            return parser_cls
        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        if name not in cls.reasoning_parsers:
            raise ValueError(f"Unknown reasoning parser {name!r}; choose one of "
                             f"{', '.join(sorted(cls.reasoning_parsers))}.")
        return cls.reasoning_parsers[name]
