"""GLM-4.5 / 4.6 (`glm45`): `<tool_call>NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>`
pairs, then `</tool_call>`. Values are text, verbatim (the tags hug them), typed by the tool's
schema like qwen3_coder's."""

from __future__ import annotations

import json
from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedToolCall
from minivllm.entrypoints.openai.tool_parsers.block_tool_parser import BlockToolParser
from minivllm.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import (param_schemas,
                                                                             typed_value)

KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"


class Glm45ToolParser(BlockToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def parse_block(self, body: str,
                    tools: list[dict[str, Any]] | None) -> list[ParsedToolCall] | None:
        name, found, rest = body.partition(KEY)
        name, rest = name.strip(), (KEY + rest).strip() if found else ""
        # a name is one bare word: a JSON body (hermes' format) is no GLM call
        if not name or any(c in name for c in ' \n\t<>{}"'):
            return None
        schemas = param_schemas(tools, name)
        arguments: dict[str, Any] = {}
        while rest:   # only key/value pairs (and whitespace) may follow the name
            if not rest.startswith(KEY):
                return None
            key, closed, rest = rest[len(KEY):].partition(KEY_END)
            rest = rest.lstrip()
            if not closed or not key.strip() or not rest.startswith(VALUE):
                return None
            value, closed, rest = rest[len(VALUE):].partition(VALUE_END)
            if not closed:
                return None
            arguments[key.strip()] = typed_value(value, schemas.get(key.strip()))
            rest = rest.strip()
        return [ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))]
