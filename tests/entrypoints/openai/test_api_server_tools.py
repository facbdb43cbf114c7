"""Tool calls on chat completions: hermes parsing (auto), required and named tool_choice enforced
by the grammar, streamed and not; the default model behind a real server (shared fixture)."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.test_api_server_features import MODEL, client, server  # noqa: F401

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {
             "name": "get_time",
             "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Forces the model to write a hermes tool call, so the auto path's parser is what is tested.
HERMES_CALL = {"structured_outputs": {
    "regex": r'Let me check\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'}}


def _stream(client, **kwargs):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                                stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or call.id
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_hermes_call_non_streamed_and_streamed(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64,
                                       temperature=0, extra_body=HERMES_CALL)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    content, calls, finish = _stream(client, max_tokens=64, temperature=0, extra_body=HERMES_CALL)
    assert content == "Let me check. " and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"]


def test_required_always_yields_a_parseable_call(client):
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=1.0, seed=seed, max_tokens=64)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)
    content, calls, finish = _stream(client, tool_choice="required", parallel_tool_calls=False,
                                     temperature=1.0, seed=9, max_tokens=64)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert all(isinstance(json.loads(c["arguments"]), dict) for c in calls)


def test_named_tool_choice_streams_argument_fragments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                       temperature=1.0, seed=1, max_tokens=48)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert r.choices[0].finish_reason == "stop"
    content, calls, _ = _stream(client, tool_choice=named, temperature=1.0, seed=1, max_tokens=48)
    assert content == "" and len(calls) == 1
    assert calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == call.function.arguments   # same seed: the same call


def test_tool_history_round_trips_and_bad_tool_choice_is_400(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."}]
    short = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="none", max_tokens=1)
    full = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                          tool_choice="none", max_tokens=1)
    assert full.usage.prompt_tokens > short.usage.prompt_tokens
    import openai
    with pytest.raises(openai.BadRequestError, match="not in `tools`"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
