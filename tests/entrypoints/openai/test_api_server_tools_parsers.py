"""--tool-call-parser mistral and pythonic behind a real server (tiny checkpoint; the answer is
forced by a regex): chat and /v1/responses return the calls, streamed and not."""

from __future__ import annotations

import json

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import openai_client, serve, write_tiny_checkpoint

MODEL = "tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
ANSWERS = {"mistral": r'Let me look\. \[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "Paris"\}',
           "pythonic": r'\[get_weather\(city="Paris"\)\]'}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tools")))


@pytest.mark.parametrize("parser", sorted(ANSWERS))
def test_parser_behind_the_server(path, parser):
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model=path, dtype="float32",
                                                     max_model_len=256, num_gpu_blocks_override=64))
    app = build_app(async_llm, MODEL, enable_auto_tool_choice=True, tool_call_parser=parser)
    forced = {"structured_outputs": {"regex": ANSWERS[parser]}}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hello world"}],
                  tools=TOOLS, max_tokens=80, temperature=0, extra_body=forced)
    with serve(async_llm, app) as server:
        client = openai_client(server)
        choice = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        response = client.responses.create(
            model=MODEL, input="Hello world", max_output_tokens=80, temperature=0,
            tools=[{"type": "function", **TOOLS[0]["function"]}], extra_body=forced)
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    assert (choice.message.content or "") == ("Let me look. " if parser == "mistral" else "")
    streamed = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == [
        ("get_weather", {"city": "Paris"})]
    [item] = [i for i in response.output if i.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments) == {"city": "Paris"}
