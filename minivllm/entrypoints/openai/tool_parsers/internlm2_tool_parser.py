"""InternLM 2 / 2.5 (`internlm`): `<|action_start|><|plugin|>{"name": ..., "parameters": {...}}
<|action_end|>` blocks (special tokens, kept by decoding with `skip_special_tokens = False`).
`<|action_start|><|interpreter|>` code blocks are not tool calls and stay content."""

from __future__ import annotations

import json
from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedToolCall,
                                                                           tool_call_from_json)
from minivllm.entrypoints.openai.tool_parsers.block_tool_parser import BlockToolParser


class InternLM2ToolParser(BlockToolParser):
    skip_special_tokens = False
    START, END = "<|action_start|><|plugin|>", "<|action_end|>"

    def parse_block(self, body: str,
                    tools: list[dict[str, Any]] | None) -> list[ParsedToolCall] | None:
        try:
            call = tool_call_from_json(json.loads(body))
        except json.JSONDecodeError:
            return None
        return None if call is None else [call]
