"""LoRA adapters in the server, with the openai client on a real loopback server: --lora-modules
adapters listed in /v1/models with their parent, selected by `model` (completions and chat,
streamed or not) with transformers + PEFT's greedy text, loaded and unloaded at run time, and
OpenAI-style 4xx errors for unknown names and bad adapters."""

from __future__ import annotations

import argparse
import os
import shutil

import httpx
import openai
import pytest
from starlette.testclient import TestClient
from transformers import PreTrainedTokenizerFast

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from minivllm.entrypoints.openai.cli import add_serve_parser
from minivllm.entrypoints.openai.cli_args import LoRAModulePath, parse_lora_module
from tests.entrypoints.openai._helpers import ServerThread, write_tiny_checkpoint
from tests.lora._lora_helpers import ALL_LINEAR, ATTENTION, hf_reference, write_adapter

MODEL = "tiny-base"
PROMPT = [5, 17, 300, 42, 7, 99, 3]
NUM_TOKENS = 6
MESSAGES = [{"role": "user", "content": "Hello world, how are you today?"}]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_server")
    base = write_tiny_checkpoint(str(root / "base"))
    return {"base": base,
            "a1": write_adapter(base, str(root / "a1"), 1, ATTENTION),
            "a2": write_adapter(base, str(root / "a2"), 2, ALL_LINEAR, r=4, alpha=4),
            "a3": write_adapter(base, str(root / "a3"), 3, ALL_LINEAR)}


@pytest.fixture(scope="module")
def server(paths):
    engine_args = EngineArgs(model=paths["base"], dtype="float32", max_model_len=128,
                             num_gpu_blocks_override=64, enable_lora=True, max_loras=2,
                             max_lora_rank=16, max_cpu_loras=2)
    async_llm = AsyncLLM.from_engine_args(engine_args)
    modules = [parse_lora_module(f"a1={paths['a1']}"),
               parse_lora_module(f'{{"name": "a2", "path": "{paths["a2"]}", '
                                 '"base_model_name": "custom-parent"}')]
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    try:
        app = build_app(async_llm, MODEL, lora_modules=modules)
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    with ServerThread(app) as running:
        running.async_llm = async_llm
        yield running
    async_llm.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=NUM_TOKENS,
                                     temperature=0).choices[0].text


def test_models_list_adapters_with_their_parent(server, paths):
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert list(cards)[:3] == [MODEL, "a1", "a2"]
    assert cards[MODEL]["parent"] is None
    assert (cards["a1"]["parent"], cards["a1"]["root"]) == (MODEL, paths["a1"])
    assert cards["a2"]["parent"] == "custom-parent"


def test_model_name_selects_the_adapter(client, paths):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(paths["base"])
    texts = {name: _complete(client, name) for name in (MODEL, "a1", "a2")}
    for name, adapter in ((MODEL, None), ("a1", paths["a1"]), ("a2", paths["a2"])):
        tokens, _ = hf_reference(paths["base"], adapter, PROMPT, num_tokens=NUM_TOKENS)
        # NOTE: a trailing incomplete UTF-8 sequence is held back by the detokenizer.
        assert texts[name] == tokenizer.decode(tokens).rstrip("\ufffd"), name
    assert len(set(texts.values())) == 3   # each adapter really changes the output
    # Responses name the adapter asked for (as vLLM's), streamed chunks too.
    assert client.completions.create(model="a2", prompt=PROMPT, max_tokens=1).model == "a2"
    chunks = client.completions.create(model="a2", prompt=PROMPT, max_tokens=2, stream=True)
    assert {c.model for c in chunks} == {"a2"}


def test_chat_streamed_and_not_use_the_adapter(client):
    def chat(model: str, stream: bool) -> str:
        kwargs = dict(model=model, messages=MESSAGES, max_tokens=NUM_TOKENS, temperature=0)
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content
        chunks = client.chat.completions.create(**kwargs, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    adapted = chat("a1", stream=False)
    assert chat("a1", stream=True) == adapted
    assert client.chat.completions.create(model="a1", messages=MESSAGES, max_tokens=1).model == "a1"
    assert chat(MODEL, stream=True) != adapted


def test_unknown_model_is_a_404_naming_the_available_ones(client):
    with pytest.raises(openai.NotFoundError, match="available models: `tiny-base`, `a1`, `a2`"):
        _complete(client, "a9")


def test_load_and_unload_at_run_time(client, server, paths):
    url = server.url
    assert "a3" not in [m.id for m in client.models.list().data]
    loaded = httpx.post(f"{url}/v1/load_lora_adapter",
                        json={"lora_name": "a3", "lora_path": paths["a3"]})
    assert loaded.status_code == 200 and "a3" in loaded.text
    assert "a3" in [m.id for m in client.models.list().data]
    assert _complete(client, "a3") != _complete(client, MODEL)
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": paths["a3"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a3")
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"


def test_bad_adapters_are_4xx_not_500(server, paths, tmp_path):
    url = f"{server.url}/v1/load_lora_adapter"
    missing = httpx.post(url, json={"lora_name": "x", "lora_path": str(tmp_path / "nope")})
    assert missing.status_code == 404 and "No adapter found" in missing.json()["error"]["message"]
    (tmp_path / "adapter_config.json").write_text("{not json")
    broken = httpx.post(url, json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert broken.status_code == 400, broken.text
    assert broken.json()["error"]["param"] == "lora_path"
    # a config that reads, beside weights that do not (safetensors' own error class was a 500)
    truncated = tmp_path / "truncated"
    shutil.copytree(paths["a3"], truncated)
    (truncated / "adapter_model.safetensors").write_bytes(b"garbage")
    unreadable = httpx.post(url, json={"lora_name": "x", "lora_path": str(truncated)})
    assert unreadable.status_code == 400, unreadable.text
    assert "adapter_model.safetensors is not a readable weights file" in \
        unreadable.json()["error"]["message"]
    assert httpx.post(url, json={"lora_name": "x"}).status_code == 400
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_runtime_routes_need_the_env_flag(server):
    # A second app around the same engine, never started: only its routes are looked at.
    app = build_app(server.async_llm, MODEL)
    response = TestClient(app).post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert response.status_code == 404


def test_lora_modules_flag_forms():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--lora-modules", "a=/p/a",
                              '{"name": "b", "path": "/p/b", "base_model_name": "m"}'])
    assert args.lora_modules == [LoRAModulePath("a", "/p/a"), LoRAModulePath("b", "/p/b", "m")]
    for bad in ("a", "=/p", '{"name": "a"}', '{"name": "a", "path": "/p", "rank": 8}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def test_several_served_names_are_aliases_of_the_base_model(server):
    # vLLM's `--served-model-name a b`: any name is accepted, responses name the first.
    app = build_app(server.async_llm, [MODEL, "alias"])   # never started: the fixture's engine runs
    client = TestClient(app)
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL, "alias"]
    body = {"model": "alias", "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0}
    done = client.post("/v1/completions", json=body)
    assert done.status_code == 200 and done.json()["model"] == MODEL
    assert done.json()["usage"]["completion_tokens"] == 2
    missing = client.post("/v1/completions", json={**body, "model": "nope"})
    assert missing.status_code == 404 and "`alias`" in missing.json()["error"]["message"]
    with pytest.raises(ValueError, match="non-empty name"):
        build_app(server.async_llm, [""])
