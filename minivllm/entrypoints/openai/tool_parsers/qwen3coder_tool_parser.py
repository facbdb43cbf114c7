"""Qwen3-Coder's XML calls (also Seed-OSS's, in other outer tags):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are plain text, so their JSON type comes from the tool's schema in the
request's `tools` (`typed_value`); glm45 shares that conversion.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedToolCall
from minivllm.entrypoints.openai.tool_parsers.block_tool_parser import BlockToolParser

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_INTEGER = re.compile(r"[-+]?[0-9]+")
_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


class Qwen3CoderToolParser(BlockToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def parse_block(self, body: str,
                    tools: list[dict[str, Any]] | None) -> list[ParsedToolCall] | None:
        call = parse_xml_function(body, tools)
        return None if call is None else [call]


class SeedOssToolParser(Qwen3CoderToolParser):
    START, END = "<seed:tool_call>", "</seed:tool_call>"


def parse_xml_function(body: str, tools: list[dict[str, Any]] | None) -> ParsedToolCall | None:
    """`<function=NAME><parameter=P>VALUE</parameter>...</function>` -> a call; None if it is
    malformed."""
    body = body.strip()
    if not body.startswith(FUNCTION) or not body.endswith(FUNCTION_END) or \
            len(body) < len(FUNCTION) + len(FUNCTION_END):
        return None
    name, found, rest = body[len(FUNCTION):-len(FUNCTION_END)].partition(">")
    name = name.strip()
    if not found or not name:
        return None
    schemas = param_schemas(tools, name)
    arguments: dict[str, Any] = {}
    rest = rest.strip()
    while rest:   # only parameters (and whitespace between them) may sit inside <function>
        if not rest.startswith(PARAMETER):
            return None
        key, found, rest = rest[len(PARAMETER):].partition(">")
        value, closed, rest = rest.partition(PARAMETER_END)
        key = key.strip()
        if not found or not closed or not key:
            return None
        # the model puts each value on lines of its own: those two newlines are layout
        value = value.removeprefix("\n").removesuffix("\n")
        arguments[key] = typed_value(value, schemas.get(key))
        rest = rest.strip()
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


def param_schemas(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """Parameter name -> its JSON schema, for the tool `name` in the request's `tools`."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type says (the text itself when it is
    not one); without a known type, JSON when the text is JSON."""
    kind = _schema_type(schema)
    text = raw.strip()
    if kind == "string":
        return raw
    if kind is None:
        return _json_or(text, raw)
    if text == "null":
        return None
    if kind == "integer":
        return _number(text, raw, integer=True)
    if kind == "number":
        return _number(text, raw, integer=False)
    if kind == "boolean":
        return text.lower() == "true" if text.lower() in ("true", "false") else raw
    if kind in ("object", "array"):
        return _json_or(text, raw)
    return raw


def _schema_type(schema: Any) -> str | None:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):   # ["integer", "null"]: the value's type is the non-null one
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def _number(text: str, raw: str, integer: bool) -> Any:
    # matched first: int() and float() would also take "1_000" or non-ASCII digits
    try:
        if _INTEGER.fullmatch(text):
            return int(text)
    except ValueError:   # more digits than Python converts
        return raw
    if integer or not _FLOAT.fullmatch(text):
        return raw
    value = float(text)
    return value if math.isfinite(value) else raw   # JSON has no Infinity


def _json_or(text: str, raw: str) -> Any:
    def no_constant(name: str) -> Any:
        raise ValueError(name)   # NaN / Infinity would make the arguments invalid JSON

    try:
        return json.loads(text, parse_constant=no_constant)
    except ValueError:   # (JSONDecodeError is one)
        return raw
