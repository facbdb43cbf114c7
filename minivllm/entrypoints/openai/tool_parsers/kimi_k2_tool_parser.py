"""Kimi K2: a `<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>` section of
`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`
calls (special tokens, kept by decoding with `skip_special_tokens = False`)."""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedToolCall,
                                                                           named_call)
from minivllm.entrypoints.openai.tool_parsers.block_tool_parser import BlockToolParser

ARGUMENTS = "<|tool_call_argument_begin|>"


class KimiK2ToolParser(BlockToolParser):
    skip_special_tokens = False
    START, END = "<|tool_call_begin|>", "<|tool_call_end|>"
    SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")

    def parse_block(self, body: str,
                    tools: list[dict[str, Any]] | None) -> list[ParsedToolCall] | None:
        call_id, found, arguments = body.partition(ARGUMENTS)
        # the id is "functions.NAME:IDX"; a name may itself hold dots or colons
        name = call_id.strip().removeprefix("functions.").rpartition(":")[0]
        return named_call(name, arguments) if found else None
