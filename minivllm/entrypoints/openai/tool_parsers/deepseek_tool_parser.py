"""DeepSeek V3 / R1 (`deepseek_v3`) and V3.1 (`deepseek_v31`): the calls follow the content in a
`<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>` section, one
`<｜tool▁call▁begin｜>` ... `<｜tool▁call▁end｜>` block each:

    V3:   function<｜tool▁sep｜>NAME\n```json\n{...}\n```
    V3.1: NAME<｜tool▁sep｜>{...}

The markers are special tokens (full-width bars, "▁" for spaces), kept by decoding with
`skip_special_tokens = False`."""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedToolCall,
                                                                           named_call)
from minivllm.entrypoints.openai.tool_parsers.block_tool_parser import BlockToolParser

SEP = "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(BlockToolParser):
    skip_special_tokens = False
    START, END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")

    def parse_block(self, body: str,
                    tools: list[dict[str, Any]] | None) -> list[ParsedToolCall] | None:
        kind, found, rest = body.partition(SEP)
        name, _, arguments = rest.partition("\n")
        arguments = arguments.strip()
        if not found or kind.strip() != "function" or not arguments.startswith("```") or \
                not arguments.endswith("```") or len(arguments) < 6:
            return None
        arguments = arguments[3:-3].removeprefix("json")   # the fence's language tag
        return named_call(name, arguments)


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):

    def parse_block(self, body: str,
                    tools: list[dict[str, Any]] | None) -> list[ParsedToolCall] | None:
        name, found, arguments = body.partition(SEP)
        return named_call(name, arguments) if found else None
