"""/v1/responses where vLLM's defaults and the context length decide: a server without
VLLM_ENABLE_RESPONSES_API_STORE keeps nothing and says how to turn storing on; truncation="auto"
drops the oldest turns of a conversation that does not fit (tiny checkpoint, real server)."""

from __future__ import annotations

import httpx
import openai
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import openai_client, serve, write_tiny_checkpoint

MODEL = "tiny"
MAX_MODEL_LEN = 96
TURNS = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."},
         {"role": "assistant", "content": "Hello world, how are you today?"},
         {"role": "user", "content": "A tiny language model for tests of the server."},
         {"role": "assistant", "content": "Once upon a time there was a cat."},
         {"role": "user", "content": "Hello world, how are you today?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("responses")))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
        async_llm = AsyncLLM.from_engine_args(EngineArgs(
            model=path, dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64))
        app = build_app(async_llm, MODEL)
    with serve(async_llm, app) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def test_without_the_store_nothing_is_kept_and_errors_say_how_to_keep_it(client):
    r = client.responses.create(model=MODEL, input="Hello world", max_output_tokens=4)
    assert r.status in ("completed", "incomplete") and r.store is False
    with pytest.raises(openai.NotFoundError, match="VLLM_ENABLE_RESPONSES_API_STORE=1"):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError, match="VLLM_ENABLE_RESPONSES_API_STORE=1"):
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    with pytest.raises(openai.BadRequestError, match="VLLM_ENABLE_RESPONSES_API_STORE=1"):
        client.responses.create(model=MODEL, input="x", background=True)


def _num_tokens(server, messages) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages})
    return r.json()["count"]


def test_truncation_auto_drops_the_oldest_turns(server, client):
    max_out = 40
    assert _num_tokens(server, TURNS) + max_out > MAX_MODEL_LEN   # the whole does not fit
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(model=MODEL, input=TURNS, max_output_tokens=max_out)
    r = client.responses.create(model=MODEL, input=TURNS, max_output_tokens=max_out,
                                truncation="auto", temperature=0)
    # What fits is the longest tail of the conversation, from its first fitting message on.
    tail = next(TURNS[k:] for k in range(len(TURNS))
                if _num_tokens(server, TURNS[k:]) + max_out <= MAX_MODEL_LEN)
    assert len(tail) < len(TURNS)
    chat = client.chat.completions.create(model=MODEL, messages=tail, max_tokens=max_out,
                                          temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.truncation == "auto"
