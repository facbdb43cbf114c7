"""Hermes 2 Pro / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

from __future__ import annotations

import json

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedToolCall,
                                                                           ToolParser,
                                                                           tool_call_from_json)
from minivllm.utils.text_utils import held_back

START, END = "<tool_call>", "</tool_call>"


class Hermes2ProToolParser(ToolParser):

    def parse(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall]]:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else tail[:len(tail) - held_back(tail, START)])
                break
            content.append(text[pos:start])
            end = text.find(END, start)
            if end < 0:
                if final:   # an unterminated block: the text stays content
                    content.append(text[start:])
                break
            call = _parse_call(text[start + len(START):end])
            if call is None:
                content.append(text[start:end + len(END)])
            else:
                calls.append(call)
            pos = end + len(END)
        return "".join(content), calls


def _parse_call(body: str) -> ParsedToolCall | None:
    try:
        return tool_call_from_json(json.loads(body))
    except json.JSONDecodeError:
        return None
