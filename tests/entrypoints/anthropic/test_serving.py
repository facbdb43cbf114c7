"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on a real server, through
the official `anthropic` client: answers equal the chat completion of the same conversation,
streamed events rebuild the same message, stop sequences, forced tool use, tool results, errors
in Anthropic's shape, and the API key as `x-api-key`."""

import re

import anthropic
import httpx
import pytest

from tests.entrypoints.openai._helpers import openai_client
from tests.entrypoints.openai.test_api_server import (MODEL, checkpoint,  # noqa: F401
                                                      running_server, server)

USER = [{"role": "user", "content": "Hello world, how are you today?"}]
# The current client sends no sampling fields of its own; vLLM's server still reads them.
GREEDY = {"temperature": 0.0}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
               "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(server):   # noqa: F811
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_answer_equals_the_chat_completion(server, client):   # noqa: F811
    system = "You are terse."
    message = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=USER,
                                     extra_body=GREEDY)
    chat = openai_client(server).chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0.0,
        messages=[{"role": "system", "content": system}, *USER])
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=USER)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_stream_rebuilds_the_message(client):
    kwargs = dict(model=MODEL, max_tokens=12, messages=USER, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens, final.usage.input_tokens) == \
        (whole.stop_reason, whole.usage.output_tokens, whole.usage.input_tokens)
    kinds = [e.type for e in client.messages.create(stream=True, **kwargs)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"


def test_stop_sequences(client):
    base = client.messages.create(model=MODEL, max_tokens=16, messages=USER, extra_body=GREEDY)
    text = base.content[0].text
    stop = text[3:5]
    assert len(text) > 6 and stop.strip()
    cut = client.messages.create(model=MODEL, max_tokens=16, messages=USER,
                                 stop_sequences=[stop], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_forced_tool_use_and_its_result(client):
    # Sampled with a seed (vLLM's extra): this tiny random model, greedy, pads JSON with spaces.
    kwargs = dict(model=MODEL, max_tokens=64, extra_body={"temperature": 1.0, "seed": 1},
                  tools=[WEATHER], messages=[{"role": "user", "content": "Weather in Paris?"}])
    named = {"type": "tool", "name": "get_weather"}
    message = client.messages.create(tool_choice=named, **kwargs)
    [call] = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")
    assert message.stop_reason == "tool_use"
    with client.messages.stream(tool_choice=named, **kwargs) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [(call.name, call.input)] and streamed.stop_reason == "tool_use"
    # "any" is chat's "required": the grammar forces a JSON list of calls (here cut short).
    anyone = client.messages.create(tool_choice={"type": "any"}, **kwargs)
    assert re.sub(r"\s", "", anyone.content[0].text).startswith('[{"name"')
    follow = [*kwargs["messages"], {"role": "assistant", "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "Sunny, 21 C"}]}]
    # (without a --tool-call-parser, "auto", the default, is refused as on chat completions)
    answer = client.messages.create(model=MODEL, max_tokens=4, messages=follow, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    before = client.messages.count_tokens(model=MODEL, messages=kwargs["messages"],
                                          tools=[WEATHER]).input_tokens
    assert answer.usage.input_tokens > before + 8


def test_errors_in_anthropic_shape(server, client):   # noqa: F811
    cases = [
        (dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]),
         anthropic.BadRequestError, "'image' is not supported"),
        (dict(model="no-such-model", max_tokens=4, messages=USER), anthropic.NotFoundError,
         "does not exist"),
        (dict(model=MODEL, max_tokens=4, messages=USER, thinking={"type": "enabled",
                                                                  "budget_tokens": 1024}),
         anthropic.BadRequestError, "thinking"),
        (dict(model=MODEL, max_tokens=4, messages=USER, tool_choice={"type": "any"}),
         anthropic.BadRequestError, "needs `tools`")]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            client.messages.create(**kwargs)
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": USER})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.text
    r = httpx.post(f"{server.url}/v1/messages", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_api_key_as_x_api_key(checkpoint):   # noqa: F811
    with running_server(checkpoint, {"api_keys": ["secret-key"]}) as keyed:
        good = anthropic.Anthropic(base_url=keyed.url, api_key="secret-key", max_retries=0)
        assert good.messages.create(model=MODEL, max_tokens=2, messages=USER).content
        bad = anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model=MODEL, max_tokens=2, messages=USER)
