"""/v1/embeddings on a real loopback server with the openai client: a tiny random causal Llama
served with --convert embed equals transformers' last-token pooling (fp32); the input forms,
base64, usage, and the 400s (dimensions, a generate model, text APIs on an embedding model)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import TEXTS, ServerThread, openai_client, write_tiny_checkpoint

MODEL = "tiny-embed"
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_embed")))


def _serve(checkpoint: str, **engine_kwargs):
    # A 16-token budget: the longer inputs are prefilled (and pooled) over several chunks.
    engine_args = EngineArgs(model=checkpoint, dtype="float32", max_model_len=128,
                             num_gpu_blocks_override=64, max_num_batched_tokens=16, **engine_kwargs)
    async_llm = AsyncLLM.from_engine_args(engine_args)
    return async_llm, ServerThread(build_app(async_llm, MODEL))


@pytest.fixture(scope="module")
def server(checkpoint):
    async_llm, thread = _serve(checkpoint, convert="embed")
    with thread as running:
        yield running
    async_llm.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Token ids -> transformers' normalised last hidden state of the last token (fp32)."""
    hf = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(ids: list[int]) -> torch.Tensor:
        return F.normalize(hf.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
    return embed


def test_strings_equal_transformers_last_token_pooling(client, checkpoint, reference):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    texts = TEXTS + [TEXTS[0] * 3]   # mixed lengths, one over several 16-token chunks
    response = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    ids = [tokenizer.encode(t) for t in texts]
    assert [d.index for d in response.data] == list(range(len(texts)))
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    for data, prompt in zip(response.data, ids):
        emb = torch.tensor(data.embedding)
        assert torch.allclose(emb, reference(prompt), atol=ATOL)
        assert emb.norm().item() == pytest.approx(1.0, abs=1e-5)


def test_token_id_inputs_and_one_string(client, reference):
    one = client.embeddings.create(model=MODEL, input=[5, 6, 7, 8], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=[[5, 6, 7, 8], [9, 10]],
                                    encoding_format="float")
    assert len(one.data) == 1 and len(many.data) == 2 and many.usage.prompt_tokens == 6
    assert torch.allclose(torch.tensor(one.data[0].embedding), reference([5, 6, 7, 8]), atol=ATOL)
    assert torch.allclose(torch.tensor(many.data[1].embedding), reference([9, 10]), atol=ATOL)
    text = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert len(text.data) == 1 and len(text.data[0].embedding) == 64


def test_base64_decodes_to_the_float_list(client, server):
    floats = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    # The openai client asks for base64 by default and decodes it itself.
    default = client.embeddings.create(model=MODEL, input=TEXTS[:2])
    raw = httpx.post(f"{server.url}/v1/embeddings", timeout=30,
                     json={"model": MODEL, "input": TEXTS[:2], "encoding_format": "base64"}).json()
    for f, d, r in zip(floats.data, default.data, raw["data"]):
        decoded = np.frombuffer(base64.b64decode(r["embedding"]), dtype="<f4")
        assert decoded.tolist() == pytest.approx(f.embedding, abs=1e-7)
        assert d.embedding == pytest.approx(f.embedding, abs=1e-7)


def test_bad_requests_are_openai_400s(client, server):
    with pytest.raises(openai.BadRequestError, match="matryoshka") as err:
        client.embeddings.create(model=MODEL, input="hello", dimensions=8)
    assert err.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.embeddings.create(model=MODEL, input=[])
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.embeddings.create(model=MODEL, input=[10 ** 6])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hello")
    with pytest.raises(openai.BadRequestError, match="Completions API"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_generate_model_refuses_embeddings(checkpoint):
    async_llm, thread = _serve(checkpoint)
    try:
        with thread as running:
            client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError, match="--runner pooling"):
                client.embeddings.create(model=MODEL, input="hello")
            assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).choices
    finally:
        async_llm.shutdown()
