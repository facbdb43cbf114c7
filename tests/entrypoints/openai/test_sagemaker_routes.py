"""SageMaker's routes on a real server: /ping as /health, /invocations answering each body as
the API it has the shape of (streamed too), and a 400 naming the APIs for any other body."""

import json

import httpx
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import ServerThread, write_tiny_checkpoint

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello world"}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": True}
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6,
              "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("sagemaker")))


def _serve(checkpoint: str, **engine_kwargs):
    args = EngineArgs(model=checkpoint, dtype="float32", max_model_len=128,
                      num_gpu_blocks_override=64, **engine_kwargs)
    async_llm = AsyncLLM.from_engine_args(args)
    return async_llm, ServerThread(build_app(async_llm, MODEL))


@pytest.fixture(scope="module")
def server(checkpoint):
    async_llm, thread = _serve(checkpoint)
    with thread as running:
        yield running
    async_llm.shutdown()


def _without_ids(response: httpx.Response) -> dict:
    body = response.json()
    body.pop("id"), body.pop("created")
    return body


def test_ping_answers_as_health(server):
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200


def test_invocations_answer_chat_and_completion_bodies_as_their_routes(server):
    for body, route in ((CHAT, "/v1/chat/completions"), (COMPLETION, "/v1/completions")):
        direct = httpx.post(f"{server.url}{route}", json=body, timeout=60)
        via = httpx.post(f"{server.url}/invocations", json=body, timeout=60)
        assert via.status_code == direct.status_code == 200
        assert _without_ids(via) == _without_ids(direct)
    streamed = httpx.post(f"{server.url}/invocations", json={**CHAT, "stream": True}, timeout=60)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                      if c["choices"])
    whole = httpx.post(f"{server.url}/invocations", json=CHAT, timeout=60).json()
    assert content == whole["choices"][0]["message"]["content"] and streamed.text.endswith(
        "data: [DONE]\n\n")


@pytest.mark.parametrize("content, message", [
    (b'{"input": "an embedding body"}', "chat completions (messages), completions (prompt)"),
    (b"[1, 2]", "takes a JSON object, got list"),
    (b"{not json", "the body is not JSON"),
])
def test_other_bodies_get_a_400_naming_the_apis(server, content, message):
    response = httpx.post(f"{server.url}/invocations", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_a_pooling_model_takes_embedding_bodies(checkpoint):
    async_llm, thread = _serve(checkpoint, convert="embed")
    try:
        with thread as server:
            body = {"model": MODEL, "input": ["Hello world", "The quick brown fox"]}
            direct = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()
            via = httpx.post(f"{server.url}/invocations", json=body, timeout=60).json()
            assert [d["embedding"] for d in via["data"]] == \
                [d["embedding"] for d in direct["data"]]
            chat = httpx.post(f"{server.url}/invocations", json=CHAT, timeout=60)
            # an embeddings body too (vLLM's chat embeddings): the chat's messages, embedded
            assert chat.status_code == 200 and chat.json()["object"] == "list"
    finally:
        async_llm.shutdown()
