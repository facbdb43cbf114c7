"""Hermes 2 Pro / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

from __future__ import annotations

import json
from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedToolCall,
                                                                           tool_call_from_json)
from minivllm.entrypoints.openai.tool_parsers.block_tool_parser import BlockToolParser


class Hermes2ProToolParser(BlockToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def parse_block(self, body: str,
                    tools: list[dict[str, Any]] | None) -> list[ParsedToolCall] | None:
        try:
            call = tool_call_from_json(json.loads(body))
        except json.JSONDecodeError:
            return None
        return None if call is None else [call]
