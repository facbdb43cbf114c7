"""Pythonic calls (Llama 3.2 / 4 and others): the answer is a Python list of calls with keyword
arguments, `[get_weather(city="Paris"), get_time()]` (Llama 4 may wrap it in
`<|python_start|>` ... `<|python_end|>`); anything else is plain content."""

from __future__ import annotations

import ast
import json
from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedToolCall,
                                                                           ToolParser)

WRAP = ("<|python_start|>", "<|python_end|>")


class PythonicToolParser(ToolParser):

    def parse(self, text: str, final: bool,
              tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedToolCall]]:
        body = text.strip().removeprefix(WRAP[0]).removesuffix(WRAP[1]).strip()
        if not body.startswith("[") and not WRAP[0].startswith(text.strip()):
            return text, []
        if not final:
            return "", []   # may still be a list of calls: decided when the answer is complete
        calls = _parse_calls(body)
        return ("", calls) if calls else (text, [])


def _parse_calls(body: str) -> list[ParsedToolCall]:
    """The calls of a literal list `[f(a=1), g()]`; [] when it is anything else."""
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            return []   # positional arguments have no parameter names to report
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except (ValueError, SyntaxError, TypeError):
            return []
        if None in arguments:   # **kwargs
            return []
        calls.append(ParsedToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls
