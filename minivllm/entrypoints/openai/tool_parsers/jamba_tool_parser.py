"""`<tool_calls>` blocks: a JSON list of {"name", "arguments"} (Jamba 1.5, and Hunyuan-A13B,
`jamba` / `hunyuan_a13b`) or one such JSON object per line (MiniMax-M1, `minimax`)."""

from __future__ import annotations

import json
from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall, tool_call_from_json, tool_calls_from_json_list)
from minivllm.entrypoints.openai.tool_parsers.block_tool_parser import BlockToolParser


class JambaToolParser(BlockToolParser):
    # Jamba's tokenizer has `<tool_calls>` as a special token; kept so the parser sees it
    skip_special_tokens = False
    START, END = "<tool_calls>", "</tool_calls>"

    def parse_block(self, body: str,
                    tools: list[dict[str, Any]] | None) -> list[ParsedToolCall] | None:
        return tool_calls_from_json_list(body)


class MinimaxToolParser(BlockToolParser):
    START, END = "<tool_calls>", "</tool_calls>"

    def parse_block(self, body: str,
                    tools: list[dict[str, Any]] | None) -> list[ParsedToolCall] | None:
        calls = []
        for line in filter(None, (line.strip() for line in body.splitlines())):
            try:
                call = tool_call_from_json(json.loads(line))
            except json.JSONDecodeError:
                return None
            if call is None:
                return None
            calls.append(call)
        return calls or None
