"""Tool-call parsers (vLLM's `--tool-call-parser` names): model text -> content and tool calls."""

from __future__ import annotations

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall, ToolParser, check_tools, tool_choice_mode, tool_choice_schema)
from minivllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from minivllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from minivllm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from minivllm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

__all__ = ["Hermes2ProToolParser", "Llama3JsonToolParser", "MistralToolParser", "ParsedToolCall",
           "PythonicToolParser", "TOOL_PARSER_NAMES", "ToolParser",
           "check_tools", "get_tool_parser", "tool_choice_mode", "tool_choice_schema"]

_TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": Hermes2ProToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_pythonic": PythonicToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}
TOOL_PARSER_NAMES = sorted(_TOOL_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    if name not in _TOOL_PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(sorted(_TOOL_PARSERS))}.")
    return _TOOL_PARSERS[name]()
