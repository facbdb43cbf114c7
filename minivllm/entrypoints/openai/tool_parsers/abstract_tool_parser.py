"""The tool-parser contract: one `parse` that streaming and non-streaming answers share."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedToolCall:
    name: str
    arguments: str   # a JSON object, as text (OpenAI's `function.arguments`)


class ToolParser:
    """Splits model text into the content a client sees and complete tool calls.

    `parse(text, final)` is called on the whole text so far: while `final` is False the content
    it returns stops before anything that may still become a tool call, so a stream can send
    content and calls as soon as they are certain.
    """

    # False: the model marks calls with a control token, so its text is decoded with special
    # tokens kept while this parser reads it.
    skip_special_tokens = True

    def parse(self, text: str, final: bool,
              tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedToolCall]]:
        """`tools` is the request's OpenAI `tools` list: parsers whose models write arguments as
        text (XML-like formats) read each parameter's JSON schema type from it."""
        raise NotImplementedError


def tool_call_from_json(obj: Any) -> ParsedToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> a call; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        return ParsedToolCall(obj["name"], arguments)
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def tool_calls_from_json_list(text: str) -> list[ParsedToolCall] | None:
    """`[{"name": ..., "arguments": {...}}, ...]` (all of `text`) -> its calls; None unless it is
    a non-empty list of calls."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [tool_call_from_json(item) for item in items]
    return None if None in calls else calls


def named_call(name: str, arguments: str) -> list[ParsedToolCall] | None:
    """[the call] when `name` is one and `arguments` the text of a JSON object, else None (the
    block stays content)."""
    name = name.strip()
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    if not name or not isinstance(parsed, dict):
        return None
    return [ParsedToolCall(name, json.dumps(parsed, ensure_ascii=False))]


def check_tools(tools: list[Any] | None) -> None:
    """ValueError naming the first entry of `tools` that is not OpenAI's {"type": "function",
    "function": {"name": str, "parameters": {...}}}: the chat template, the tool_choice schema
    and the parsers read those keys."""
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": '
                             '{"name": ..., "parameters": {...}}}.')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string.")
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object.")


def tool_choice_mode(tools: list[dict[str, Any]] | None, tool_choice: Any) -> str | None:
    """None (no tool parsing), "auto", "required" or "named" (OpenAI's default: "auto" with
    tools, else "none"); raises ValueError naming the valid choices."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return None
    if not tools:
        raise ValueError("tool_choice needs `tools`.")
    if choice in ("auto", "required"):
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        _find_tool(tools, choice["function"].get("name"))
        return "named"
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                     '{"type": "function", "function": {"name": ...}}.')


def tool_choice_schema(tools: list[dict[str, Any]] | None, tool_choice: Any,
                       parallel: bool) -> dict[str, Any] | None:
    """The JSON schema that enforces a "required" (a list of {name, parameters} calls, one
    unless parallel) or named (that tool's arguments) tool_choice; None for the others."""
    mode = tool_choice_mode(tools, tool_choice)
    if mode == "named":
        return _find_tool(tools, tool_choice["function"]["name"]).get(
            "parameters", {"type": "object"})
    if mode != "required":
        return None
    # exactly {name, parameters}: a call with extra keys is no call the parser could return
    calls = [{"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": t["function"].get("parameters", {"type": "object"})}}
             for t in tools if isinstance(t.get("function"), dict) and "name" in t["function"]]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _find_tool(tools: list[dict[str, Any]], name: Any) -> dict[str, Any]:
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(name, str) and function.get("name") == name:
            return function
    raise ValueError(f"tool_choice names {name!r}, which is not in `tools`.")
