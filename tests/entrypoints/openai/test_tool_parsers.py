"""Tool parsers: hermes blocks, llama3 JSON, mistral (both formats) and pythonic lists, whole and
as a stream sees them (held-back text)."""

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


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text", [
    'Let me look. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
    'Let me look. [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}',
])
def test_mistral_both_formats_and_every_prefix(text):
    parser = get_tool_parser("mistral")
    assert not parser.skip_special_tokens   # [TOOL_CALLS] is a control token
    content, calls = parser.parse(text, final=True)
    assert content == "Let me look. " and _calls(calls) == [("f", {"a": 1}), ("g", {})]
    sent = ""
    for end in range(1, len(text) + 1):
        content, calls = parser.parse(text[:end], final=False)
        assert content.startswith(sent) and "[" not in content and calls == []
        sent = content
    assert sent == "Let me look. "
    for broken in ("[TOOL_CALLS][{\"name\": 1}]", "[TOOL_CALLS]f[ARGS]{oops", "[TOOL_CALLS]f"):
        assert parser.parse(broken, final=True) == (broken, [])
    assert parser.parse("[no call]", final=True) == ("[no call]", [])


def test_pythonic_calls():
    parser = get_tool_parser("pythonic")
    text = '[get_weather(city="Paris", days=2), get_time()]'
    content, calls = parser.parse(text, final=True)
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Paris", "days": 2}),
                                               ("get_time", {})]
    wrapped = "<|python_start|>" + text + "<|python_end|>"
    assert len(parser.parse(wrapped, final=True)[1]) == 2
    assert parser.parse(text[:12], final=False) == ("", [])
    assert parser.parse("<|python_st", final=False) == ("", [])
    assert parser.parse("Paris is sunny.", final=False) == ("Paris is sunny.", [])
    for not_calls in ("[1, 2]", "[f(1)]", "[f(x=g())]", "[f(**k)]", "[a.b(x=1)]", "[f(x=1"):
        assert parser.parse(not_calls, final=True) == (not_calls, [])


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes, hunyuan_a13b, internlm, jamba, kimi_k2, "
                       "llama3_json, llama4_json, llama4_pythonic, minimax, mistral, "
                       "phi4_mini_json, pythonic, qwen3_coder"):
        get_tool_parser("nope")
