"""/pooling (the pooler's own output) and /v1/embeddings of a chat (`messages` through the
template) on a real server of a tiny embedding model (`--convert embed`)."""

from __future__ import annotations

import httpx
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import TEXTS, serve, write_tiny_checkpoint

MODEL = "embedder"
MESSAGES = [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": TEXTS[1]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("pooling")))
    async_llm = AsyncLLM.from_engine_args(EngineArgs(
        model=path, dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
        convert="embed"))
    with serve(async_llm, build_app(async_llm, MODEL)) as server:
        yield server


def _post(server, route, **body):
    return httpx.post(f"{server.url}{route}", json={"model": MODEL, **body}, timeout=60)


def test_pooling_returns_the_poolers_vectors(server):
    pooled = _post(server, "/pooling", input=TEXTS)
    embedded = _post(server, "/v1/embeddings", input=TEXTS)
    assert pooled.status_code == 200, pooled.text
    data = pooled.json()["data"]
    assert [d["object"] for d in data] == ["pooling"] * len(TEXTS)
    for item, ref in zip(data, embedded.json()["data"]):
        assert item["data"] == pytest.approx(ref["embedding"], abs=1e-6)
    assert pooled.json()["usage"]["prompt_tokens"] == embedded.json()["usage"]["prompt_tokens"]


def test_embedding_of_a_chat_is_the_embedding_of_its_rendered_prompt(server):
    ids = _post(server, "/tokenize", messages=MESSAGES, add_generation_prompt=False).json()
    chat = _post(server, "/v1/embeddings", messages=MESSAGES)
    by_ids = _post(server, "/v1/embeddings", input=ids["tokens"])
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == ids["count"]
    assert chat.json()["data"][0]["embedding"] == pytest.approx(
        by_ids.json()["data"][0]["embedding"], abs=1e-6)
    both = _post(server, "/v1/embeddings", messages=MESSAGES, input="x")
    neither = _post(server, "/v1/embeddings")
    assert both.status_code == neither.status_code == 400
    assert (both.json()["error"]["param"], neither.json()["error"]["param"]) == ("messages",
                                                                                "input")
