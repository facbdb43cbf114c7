"""IBM Granite 3.x (`granite`): the whole answer is `<|tool_call|>` (or the older `<tool_call>`)
then a JSON list of {"name", "arguments"}; anything else is plain content. No end marker:
the calls are known once the answer is complete."""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall, ToolParser, tool_calls_from_json_list)


class LeadingMarkerToolParser(ToolParser):
    """An answer that opens with one of MARKERS and goes on with a JSON list of calls."""

    MARKERS: tuple[str, ...] = ()

    def parse(self, text: str, final: bool,
              tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedToolCall]]:
        body = text.lstrip()
        marker = next((m for m in self.MARKERS if body.startswith(m)), None)
        if marker is None:
            if not final and any(m.startswith(body) for m in self.MARKERS):
                return "", []   # still a possible marker (or nothing yet but whitespace)
            return text, []
        if not final:
            return "", []   # the list ends with the answer: decided when it is complete
        calls = tool_calls_from_json_list(body[len(marker):])
        return ("", calls) if calls else (text, [])


class GraniteToolParser(LeadingMarkerToolParser):
    # `<|tool_call|>` is a special token of Granite's tokenizer: kept so the parser sees it
    skip_special_tokens = False
    MARKERS = ("<|tool_call|>", "<tool_call>")
