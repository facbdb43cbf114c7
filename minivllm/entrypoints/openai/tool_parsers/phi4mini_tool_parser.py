"""Phi-4-mini (`phi4_mini_json`): the whole answer is `functools[{"name": ..., "arguments":
{...}}, ...]`; anything else is plain content."""

from __future__ import annotations

from minivllm.entrypoints.openai.tool_parsers.granite_tool_parser import LeadingMarkerToolParser


class Phi4MiniJsonToolParser(LeadingMarkerToolParser):
    MARKERS = ("functools",)
