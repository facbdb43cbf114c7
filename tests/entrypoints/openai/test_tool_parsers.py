"""Tool parsers: hermes blocks and llama3 JSON, whole and as a stream sees them (held-back text)."""

import json

import pytest

from minivllm.entrypoints.openai.tool_parsers import get_tool_parser

HERMES = ('Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> and '
          '<tool_call>{"name": "g", "arguments": {}}</tool_call>')


def test_hermes_whole_and_every_prefix():
    parser = get_tool_parser("hermes")
    content, calls = parser.parse(HERMES, final=True)
    assert content == "Sure.  and " and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": 1}), ("g", {})]
    sent, num_calls = "", 0
    for end in range(1, len(HERMES) + 1):   # a stream's view: content never shows a tag
        content, calls = parser.parse(HERMES[:end], final=False)
        assert content.startswith(sent) and "<" not in content
        assert len(calls) >= num_calls
        sent, num_calls = content, len(calls)
    assert sent == "Sure.  and " and num_calls == 2
    assert parser.parse("x <tool_call>{broken", final=True) == ("x <tool_call>{broken", [])


def test_llama3_json():
    parser = get_tool_parser("llama3_json")
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    content, calls = parser.parse(text, final=True)
    assert content == "" and [c.name for c in calls] == ["f", "g"]
    assert parser.parse(text[:20], final=False) == ("", [])
    assert parser.parse("Hello there", final=False) == ("Hello there", [])
    assert parser.parse('{"not": "a call"}', final=True) == ('{"not": "a call"}', [])


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("nope")
