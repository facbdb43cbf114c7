"""Mistral: `[TOOL_CALLS]` then the calls, either as one JSON list of {"name", "arguments"}
(the v3 tokenizers) or as `name[ARGS]{...}` per call (v11 and later); text before the first
`[TOOL_CALLS]` is content. `[TOOL_CALLS]` is a control token, so the server decodes with
special tokens kept (`skip_special_tokens = False`)."""

from __future__ import annotations

import json
from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedToolCall,
                                                                           ToolParser,
                                                                           tool_call_from_json)
from minivllm.utils.text_utils import held_back

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    skip_special_tokens = False

    def parse(self, text: str, final: bool,
              tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedToolCall]]:
        start = text.find(BOT)
        if start < 0:
            return (text, []) if final else (text[:len(text) - held_back(text, BOT)], [])
        if not final:
            return text[:start], []   # the calls are parsed once complete
        calls = _parse_calls(text[start:])
        return (text[:start], calls) if calls else (text, [])


def _parse_calls(body: str) -> list[ParsedToolCall]:
    """`[TOOL_CALLS][...]` or `[TOOL_CALLS]name[ARGS]{...}` repeated; [] if malformed."""
    decoder, calls = json.JSONDecoder(), []
    for chunk in body.split(BOT)[1:]:
        chunk = chunk.strip()
        if chunk.startswith("["):
            try:
                items, end = decoder.raw_decode(chunk)
            except json.JSONDecodeError:
                return []
            parsed = [tool_call_from_json(i) for i in items] if isinstance(items, list) else [None]
        else:
            name, found, rest = chunk.partition(ARGS)
            try:
                arguments, end = decoder.raw_decode(rest.strip()) if found else (None, 0)
            except json.JSONDecodeError:
                return []
            parsed = [tool_call_from_json({"name": name.strip(), "arguments": arguments})
                      if isinstance(arguments, dict) and name.strip() else None]
        if None in parsed:
            return []
        calls += parsed
    return calls
