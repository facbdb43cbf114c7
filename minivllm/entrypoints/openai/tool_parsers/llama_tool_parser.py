"""Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (several
joined by `;`), optionally after `<|python_tag|>`; anything else is plain content."""

from __future__ import annotations

import json
from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedToolCall,
                                                                           ToolParser,
                                                                           tool_call_from_json)

BOT = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):

    def parse(self, text: str, final: bool,
              tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedToolCall]]:
        body = text.strip()
        body = body[len(BOT):].lstrip() if body.startswith(BOT) else body
        if not body.startswith("{") and not BOT.startswith(body):
            return text, []
        if not final:
            return "", []   # may still be a call: decided when the answer is complete
        calls = _parse_calls(body)
        return ("", calls) if calls else (text, [])


def _parse_calls(body: str) -> list[ParsedToolCall]:
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return []
        call = tool_call_from_json(obj)
        if call is None:
            return []
        calls.append(call)
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return calls
