"""The block parsers (qwen3_coder / seed_oss XML, glm45, deepseek_v3 / v31, kimi_k2, jamba /
hunyuan_a13b, minimax, internlm) and the whole-answer ones (granite, phi4_mini_json, xlam):
whole text, every prefix as a stream sees it, malformed calls kept as content, and the XML
formats' parameter values typed by the request's tool schemas."""

from __future__ import annotations

import json

import pytest

from minivllm.entrypoints.openai.tool_parsers import (BlockToolParser, TOOL_PARSER_NAMES,
                                                      get_tool_parser)

BOTH = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def check_stream(parser, text, tools=None, settled=True):
    """Parses every prefix of `text` as a stream would: content and calls only grow and the
    content never shows a marker's first character ("<" for every format here, "`", "[" and
    "f" too for the whole-answer ones, whose content is held back whole). Returns the parse of
    the whole text, which must extend (`settled`: equal) the last streamed state."""
    sent, sent_calls = "", []
    forbidden = "<" if isinstance(parser, BlockToolParser) else "<[`f"
    for end in range(len(text) + 1):
        content, calls = parser.parse(text[:end], final=False, tools=tools)
        assert content.startswith(sent), (text[:end], content, sent)
        assert calls[:len(sent_calls)] == sent_calls, text[:end]
        assert not any(c in content for c in forbidden), (text[:end], content)
        sent, sent_calls = content, calls
    content, calls = parser.parse(text, final=True, tools=tools)
    assert content.startswith(sent) and calls[:len(sent_calls)] == sent_calls
    if settled:
        assert (content, calls) == (sent, sent_calls)
    return content, calls


def _xml_call(name, params, start="<tool_call>", end="</tool_call>"):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"{start}\n<function={name}>\n{body}</function>\n{end}"


@pytest.mark.parametrize("name,start,end", [
    ("qwen3_coder", "<tool_call>", "</tool_call>"),
    ("qwen3_xml", "<tool_call>", "</tool_call>"),
    ("seed_oss", "<seed:tool_call>", "</seed:tool_call>"),
])
def test_xml_calls_whole_and_every_prefix(name, start, end):
    parser = get_tool_parser(name)
    text = ("Let me check.\n" + _xml_call("get_weather", {"city": "Paris", "days": 3}, start, end)
            + "\n" + _xml_call("get_time", {}, start, end))
    content, calls = check_stream(parser, text)
    assert content == "Let me check.\n\n"
    assert _calls(calls) == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
    broken = [f"x {start}\n<function=f>\n<parameter=a>\n1\n</function>\n{end}",   # open param
              f"x {start}\n<function=f>\n<parameter=a>\n1\n</parameter>\n{end}",  # no </function>
              f'x {start}{{"name": "f", "arguments": {{}}}}{end}',                # hermes JSON
              f"x {start}\n<function=f>\nstray\n</function>\n{end}",
              f"x {start}\n<function=f>\n<parameter=a>\n1\n"]                      # unterminated
    for text in broken:
        assert parser.parse(text, final=True) == (text, [])


SCHEMA_TOOLS = [{"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {
        "nights": {"type": "integer"}, "budget": {"type": "number"}, "price": {"type": "number"},
        "breakfast": {"type": "boolean"}, "guests": {"type": "object"},
        "rooms": {"type": "array"}, "zip": {"type": "string"}, "note": {"type": "string"},
        "floor": {"type": ["integer", "null"]}, "pet": {"type": "integer"},
        "bad": {"type": "object"}, "count": {"type": "integer"},
        "alias": {"type": "string"}}}}}]
VALUES = {"nights": "2", "budget": "120.5", "price": "100", "breakfast": "True",
          "guests": '{"adults": 2}', "rooms": "[1, 2]", "zip": "12345",
          "note": "\n  indented\nsecond\n", "floor": "null", "pet": "dog", "bad": "{oops",
          "count": "1_000", "extra": "free text", "flag": "false", "alias": "null"}
TYPED = {"nights": 2, "budget": 120.5, "price": 100, "breakfast": True, "guests": {"adults": 2},
         "rooms": [1, 2], "zip": "12345", "note": "\n  indented\nsecond\n", "floor": None,
         "pet": "dog", "bad": "{oops", "count": "1_000", "extra": "free text", "flag": False,
         "alias": "null"}


def _glm_call(name, params):
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                    for k, v in params.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


@pytest.mark.parametrize("name,make", [("qwen3_coder", _xml_call), ("glm45", _glm_call)])
def test_values_typed_by_the_tool_schema(name, make):
    parser = get_tool_parser(name)
    text = make("book", VALUES)
    [call] = parser.parse(text, final=True, tools=SCHEMA_TOOLS)[1]
    arguments = json.loads(call.arguments)
    assert arguments == TYPED
    assert type(arguments["price"]) is int and type(arguments["budget"]) is float
    # without the schema a value is JSON when it parses as JSON, else the text
    [call] = parser.parse(text, final=True)[1]
    untyped = json.loads(call.arguments)
    assert untyped["zip"] == 12345 and untyped["breakfast"] == "True" and untyped["pet"] == "dog"
    # another tool's schema types nothing here
    other = [{"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"zip": {"type": "string"}}}}}]
    assert json.loads(parser.parse(text, final=True, tools=other)[1][0].arguments)["zip"] == 12345
    assert "über" in parser.parse(make("f", {"s": "über"}), final=True)[1][0].arguments


def test_glm45_whole_and_every_prefix():
    parser = get_tool_parser("glm45")
    text = ("Checking." + _glm_call("get_weather", {"city": "Paris", "days": 3})
            + _glm_call("get_time", {}))
    content, calls = check_stream(parser, text)
    assert content == "Checking."
    assert _calls(calls) == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
    for text in ['x <tool_call>{"name": "f", "arguments": {}}</tool_call>',   # hermes JSON
                 "x <tool_call>f\n<arg_key>a</arg_key>\n</tool_call>",        # no value
                 "x <tool_call>f\n<arg_key>a</arg_key><arg_value>1</tool_call>",
                 "x <tool_call>f\nstray<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
                 "x <tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>"]:
        assert parser.parse(text, final=True) == (text, [])


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DSV3 = (f"Let me check.{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
        f'{{"city": "Paris"}}\n```{DS_CALL_END}\n{DS_CALL}function{DS_SEP}get_time\n```json\n'
        f"{{}}\n```{DS_CALL_END}{DS_END}")
DSV31 = (f'Let me check.{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris"}}{DS_CALL_END}'
         f"{DS_CALL}get_time{DS_SEP}{{}}{DS_CALL_END}{DS_END}")
KIMI = ("Let me check. <|tool_calls_section_begin|> <|tool_call_begin|> functions.get_weather:0 "
        '<|tool_call_argument_begin|> {"city": "Paris"} <|tool_call_end|>\n<|tool_call_begin|>'
        "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>")
JAMBA = ('Let me check.<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {}}]</tool_calls>')
MINIMAX = ('Let me check.<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
           '{"name": "get_time", "arguments": {}}\n</tool_calls>')
INTERNLM = ('Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": '
            '{"city": "Paris"}}<|action_end|><|action_start|><|plugin|>\n{"name": "get_time", '
            '"parameters": {}}<|action_end|>')


@pytest.mark.parametrize("name,text,special", [
    ("deepseek_v3", DSV3, True), ("deepseek_v31", DSV31, True), ("kimi_k2", KIMI, True),
    ("jamba", JAMBA, True), ("hunyuan_a13b", JAMBA, True), ("minimax", MINIMAX, False),
    ("internlm", INTERNLM, True),
])
def test_block_formats_whole_and_every_prefix(name, text, special):
    parser = get_tool_parser(name)
    assert parser.skip_special_tokens is not special   # the markers must reach the parser
    content, calls = check_stream(parser, text)
    # section markers and the whitespace between calls inside them are not content (kimi's
    # space before its section is)
    assert content == ("Let me check. " if name == "kimi_k2" else "Let me check.")
    assert _calls(calls) == BOTH
    # a text without calls is all content, and streams at once
    assert parser.parse("Hello there.", final=False) == ("Hello there.", [])


@pytest.mark.parametrize("name,block", [
    ("deepseek_v3", f"{DS_CALL}function{DS_SEP}f\n{{}}{DS_CALL_END}"),   # no fence
    ("deepseek_v3", f"{DS_CALL}tool{DS_SEP}f\n```json\n{{}}\n```{DS_CALL_END}"),
    ("deepseek_v31", f"{DS_CALL}f{DS_SEP}{{oops{DS_CALL_END}"),
    ("deepseek_v31", f"{DS_CALL}f{{}}{DS_CALL_END}"),   # no separator
    ("kimi_k2", "<|tool_call_begin|>functions.f<|tool_call_argument_begin|>{}"   # no :IDX
     "<|tool_call_end|>"),
    ("kimi_k2", "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]"
     "<|tool_call_end|>"),
    ("jamba", '<tool_calls>[{"name": 1, "arguments": {}}]</tool_calls>'),
    ("jamba", "<tool_calls>[]</tool_calls>"),
    ("minimax", '<tool_calls>\n{"name": "f", "arguments": {}}\nnot json\n</tool_calls>'),
    ("internlm", '<|action_start|><|plugin|>{"name": "f", "parameters": {}<|action_end|>'),
])
def test_malformed_blocks_stay_content(name, block):
    parser = get_tool_parser(name)
    assert parser.parse("x " + block, final=True) == ("x " + block, [])
    unterminated = "x " + block[:len(block) // 2 + 8]
    assert parser.parse(unterminated, final=True) == (unterminated, [])
    assert parser.parse(unterminated, final=False) == ("x ", [])   # may still become a call


def test_section_markers_alone_and_kept_content():
    parser = get_tool_parser("deepseek_v31")
    call = f'{DS_CALL}f{DS_SEP}{{"a": 1}}{DS_CALL_END}'
    # words inside a section are content; only whitespace between calls is dropped
    content, calls = parser.parse(f"Hi{DS_BEGIN}{call} and {call}\n{DS_END} bye", final=True)
    assert content == "Hi and  bye" and _calls(calls) == [("f", {"a": 1})] * 2
    # the calls end with the answer even when the model stops before the section's end
    assert parser.parse(f"Hi{DS_BEGIN}{call}", final=True)[1] == calls[:1]
    # an unterminated call inside a section: its text stays content, the section marker not
    assert parser.parse(f"Hi{DS_BEGIN}{call[:-5]}", final=True) == (f"Hi{call[:-5]}", [])
    assert get_tool_parser("internlm").parse(
        "<|action_start|><|interpreter|>print(1)<|action_end|>", final=True) == (
        "<|action_start|><|interpreter|>print(1)<|action_end|>", [])


GRANITE_CALLS = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_time", "arguments": {}}]')


@pytest.mark.parametrize("name,text", [
    ("granite", " <|tool_call|>" + GRANITE_CALLS),
    ("granite", "<tool_call>" + GRANITE_CALLS),
    ("phi4_mini_json", "functools" + GRANITE_CALLS),
    ("xlam", GRANITE_CALLS),
    ("xlam", "\n```json\n" + GRANITE_CALLS + "\n```\n"),
    ("xlam", "```" + GRANITE_CALLS + "```"),
    ("xlam", "[TOOL_CALLS]" + GRANITE_CALLS),
    ("xlam", "<tool_call>" + GRANITE_CALLS + "</tool_call>"),
])
def test_whole_answer_calls_and_every_prefix(name, text):
    content, calls = check_stream(get_tool_parser(name), text, settled=False)
    assert content == "" and _calls(calls) == BOTH


@pytest.mark.parametrize("name,text,streamed", [
    ("granite", "Paris is sunny.", "Paris is sunny."),   # streams at once
    ("granite", "<b>bold</b>", "<b>bold</b>"),           # decided once it can be no marker
    ("granite", "<|tool_c", ""),
    ("granite", "<|tool_call|>" + GRANITE_CALLS[:-1], ""),
    ("granite", '<|tool_call|>[{"name": 1, "arguments": {}}]', ""),
    ("granite", "<|tool_call|>[] and words", ""),
    ("phi4_mini_json", "functools is a Python module.", ""),
    ("phi4_mini_json", "fun", ""),
    ("phi4_mini_json", "Use functools" + GRANITE_CALLS, "Use functools" + GRANITE_CALLS),
    ("xlam", "Paris is sunny.", "Paris is sunny."),
    ("xlam", "[1, 2]", ""),
    ("xlam", "```python\nprint(1)\n```", ""),
    ("xlam", "```json\n" + GRANITE_CALLS, ""),                   # open fence
    ("xlam", "<tool_call>" + GRANITE_CALLS, ""),                 # open wrapper
    ("xlam", GRANITE_CALLS + " and more", ""),
])
def test_whole_answer_non_calls_are_content(name, text, streamed):
    parser = get_tool_parser(name)
    assert parser.parse(text, final=False) == (streamed, [])
    assert parser.parse(text, final=True) == (text, [])


def test_new_names_are_registered():
    new = {"qwen3_coder", "qwen3_xml", "seed_oss", "glm45", "deepseek_v3", "deepseek_v31",
           "kimi_k2", "jamba", "hunyuan_a13b", "minimax", "internlm", "granite",
           "phi4_mini_json", "xlam", "llama4_json"}
    assert new <= set(TOOL_PARSER_NAMES)
    assert get_tool_parser("hermes").parse(  # hermes now rides on the block base
        'a<tool_call>{"name": "f", "arguments": {}}</tool_call>b', final=True)[0] == "ab"
    text = '{"name": "f", "parameters": {"a": 1}}'   # llama4_json reads llama 3's format
    assert _calls(get_tool_parser("llama4_json").parse(text, final=True)[1]) == [("f", {"a": 1})]
