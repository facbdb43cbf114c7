"""Salesforce xLAM: the whole answer is a JSON list of {"name", "arguments"}, bare, in a
```json fence, after `[TOOL_CALLS]` or inside `<tool_call>` ... `</tool_call>`; anything else
is plain content."""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall, ToolParser, tool_calls_from_json_list)

FENCE, BOT, WRAP = "```", "[TOOL_CALLS]", ("<tool_call>", "</tool_call>")


class XLAMToolParser(ToolParser):

    def parse(self, text: str, final: bool,
              tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedToolCall]]:
        body = text.strip()
        # "[" also opens [TOOL_CALLS]; "<" a <tool_call> wrapper; "`" a fence
        if not body.startswith(("[", "<")) and not body.startswith(FENCE) and \
                not FENCE.startswith(body):
            return text, []
        if not final:
            return "", []   # may still be a list of calls: decided when the answer is complete
        calls = tool_calls_from_json_list(_unwrap(body))
        return ("", calls) if calls else (text, [])


def _unwrap(body: str) -> str:
    """The JSON list inside the answer's wrapping ("" when a wrapper is not closed)."""
    if body.startswith(BOT):
        return body[len(BOT):]
    if body.startswith(WRAP[0]):
        return body[len(WRAP[0]):-len(WRAP[1])] if body.endswith(WRAP[1]) and \
            len(body) >= len(WRAP[0]) + len(WRAP[1]) else ""
    if body.startswith(FENCE):
        return body[len(FENCE):-len(FENCE)].removeprefix("json") if body.endswith(FENCE) and \
            len(body) >= 2 * len(FENCE) else ""
    return body
