"""/classify, /score and /rerank on real servers of tiny checkpoints: a three-label classifier,
a one-label cross-encoder and an embedding model, each against transformers or the offline
`LLM` on the same weights."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import TEXTS, serve, write_tiny_checkpoint
from tests.entrypoints.test_llm_score import LABELS, QUERY, hf_logits, write_classifier

MODEL = "scorer"


def _server(path: str, **kwargs):
    async_llm = AsyncLLM.from_engine_args(EngineArgs(
        model=path, dtype="float32", max_model_len=128, num_gpu_blocks_override=64, **kwargs))
    return serve(async_llm, build_app(async_llm, MODEL))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path = write_classifier(str(tmp_path_factory.mktemp("cross")), LlamaConfig,
                            LlamaForSequenceClassification, 1)
    with _server(path) as server:
        yield server, path


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json={"model": MODEL, **body}, timeout=60)


def test_score_and_rerank_of_a_cross_encoder(cross_encoder):
    server, path = cross_encoder
    tokenizer = AutoTokenizer.from_pretrained(path)
    expected = [float(hf_logits(path, LlamaForSequenceClassification,
                                tokenizer(text=QUERY, text_pair=t)["input_ids"]).sigmoid()[0])
                for t in TEXTS]
    for route, body in (("/score", {"text_1": QUERY, "text_2": TEXTS}),
                        ("/v1/score", {"queries": QUERY, "documents": TEXTS})):
        r = _post(server, route, body)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2, 3] and data[0]["object"] == "score"
        assert [d["score"] for d in data] == pytest.approx(expected, abs=1e-5)
        assert r.json()["usage"]["prompt_tokens"] > 0
    documents = [TEXTS[0], {"text": TEXTS[1]}, TEXTS[2], TEXTS[3]]
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(server, route, {"query": QUERY, "documents": documents, "top_n": 2})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        best = sorted(range(4), key=lambda i: -expected[i])[:2]
        assert [x["index"] for x in results] == best
        assert [x["document"]["text"] for x in results] == [TEXTS[i] for i in best]
        assert [x["relevance_score"] for x in results] == pytest.approx(
            [expected[i] for i in best], abs=1e-5)


@pytest.mark.parametrize("route, body, param", [
    ("/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "text_1"),
    ("/score", {"text_1": QUERY}, "text_2"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/embeddings", {"input": QUERY}, None),
])
def test_bad_requests_are_400s(cross_encoder, route, body, param):
    r = _post(cross_encoder[0], route, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    r = _post(cross_encoder[0], "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "/classify, /score" in r.json()["error"]["message"]


def test_classify_returns_labels_and_probabilities(tmp_path):
    path = write_classifier(str(tmp_path), LlamaConfig, LlamaForSequenceClassification, 3,
                            id2label=LABELS)
    with _server(path) as server:
        r = _post(server, "/classify", {"input": TEXTS})
        raw = _post(server, "/classify", {"input": TEXTS[0], "use_activation": False})
        bad = _post(server, "/score", {"text_1": QUERY, "text_2": TEXTS})
    assert r.status_code == 200, r.text
    tokenizer = AutoTokenizer.from_pretrained(path)
    for item, text in zip(r.json()["data"], TEXTS):
        ref = hf_logits(path, LlamaForSequenceClassification, tokenizer.encode(text)).softmax(-1)
        assert item["num_classes"] == 3 and item["probs"] == pytest.approx(ref.tolist(), abs=1e-5)
        assert item["label"] == LABELS[int(ref.argmax())]
    logits = hf_logits(path, LlamaForSequenceClassification, tokenizer.encode(TEXTS[0]))
    assert raw.json()["data"][0]["probs"] == pytest.approx(logits.tolist(), abs=1e-4)
    assert bad.status_code == 400 and "3 labels" in bad.json()["error"]["message"]


def test_score_of_an_embedding_model_is_the_cosine(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path))
    with _server(path, convert="embed") as server:
        scores = _post(server, "/score", {"text_1": QUERY, "text_2": TEXTS}).json()["data"]
        vectors = _post(server, "/v1/embeddings", {"input": [QUERY, *TEXTS]}).json()["data"]
        bad = _post(server, "/classify", {"input": QUERY})
    vectors = [torch.tensor(v["embedding"]) for v in vectors]
    for item, vector in zip(scores, vectors[1:]):
        assert item["score"] == pytest.approx(float(torch.nn.functional.cosine_similarity(
            vectors[0], vector, dim=0)), abs=1e-5)
    assert bad.status_code == 400 and "LLM.embed" in bad.json()["error"]["message"]
