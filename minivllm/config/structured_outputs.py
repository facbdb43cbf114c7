"""vLLM's StructuredOutputsConfig: the grammar backend, and the reasoning parser whose end of
reasoning is where a request's grammar starts to apply."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.reasoning import ReasoningParserManager

BACKENDS = ("auto", "guidance")


@dataclass
class StructuredOutputsConfig:
    backend: str = "auto"            # llguidance either way
    reasoning_parser: str = ""       # "" : none; else a --reasoning-parser name

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"Unknown structured outputs backend {self.backend!r}; choose one "
                             f"of {', '.join(BACKENDS)}.")
        if self.reasoning_parser:
            ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)   # names the known
