"""vLLM's `use_beam_search` on the server (n = the beam width), on a tiny fp32 checkpoint behind
a real uvicorn: the choices are the offline LLM.beam_search's best beams, streamed or not, for
completions and chat; options beam search does not apply are 400s; a client that leaves
mid-search frees the engine."""

import re
import time

import httpx
import openai
import pytest

from minivllm import LLM
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from minivllm.sampling_params import BeamSearchParams
from tests.entrypoints.openai._helpers import openai_client, serve, write_tiny_checkpoint

MODEL = "tiny"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello world, how are you today?"}]
BEAM = {"use_beam_search": True}


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("beam_server")))


@pytest.fixture(scope="module")
def server(path):
    args = EngineArgs(model=path, dtype="float32", max_model_len=256, num_gpu_blocks_override=256)
    async_llm = AsyncLLM.from_engine_args(args)
    with serve(async_llm, build_app(async_llm, MODEL)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=path, dtype="float32", max_model_len=256, num_gpu_blocks_override=256)


def _expected(llm, prompt_ids, width, max_tokens, length_penalty=1.0):
    """(text, finish_reason, completion tokens) of the offline search's beams, as the server
    answers: the generated part, a final eos out of the text."""
    [out] = llm.beam_search({"prompt_token_ids": prompt_ids}, BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty))
    tokenizer, n = llm.get_tokenizer(), len(prompt_ids)
    return [(tokenizer.decode(s.tokens[n:-1] if s.finish_reason == "stop" else s.tokens[n:],
                              skip_special_tokens=True), s.finish_reason, len(s.tokens) - n)
            for s in out.sequences]


def test_completions_are_the_offline_beams_streamed_or_not(client, llm):
    expected = _expected(llm, llm.llm_engine.tokenize_prompt(PROMPT), 3, 10)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=3, extra_body=BEAM)
    assert [(c.text, c.finish_reason) for c in r.choices] == [e[:2] for e in expected]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(e[2] for e in expected)
    texts = {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=3,
                                           stream=True, extra_body=BEAM):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [e[0] for e in expected]


def test_chat_is_the_offline_search_on_the_chat_prompt(client, llm):
    ids = llm.apply_chat_template(MESSAGES)
    expected = _expected(llm, ids, 2, 8, length_penalty=0.5)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=2,
                                       extra_body={**BEAM, "length_penalty": 0.5})
    assert [(c.message.content, c.finish_reason) for c in r.choices] == [e[:2] for e in expected]
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("body, param", [
    ({"stop": ["x"]}, "stop"), ({"logprobs": 2}, "logprobs"), ({"top_p": 0.5}, "top_p"),
    ({"n": 11}, "n"), ({"length_penalty": "long"}, "length_penalty"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
])
def test_options_beam_search_does_not_apply_are_400s(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **BEAM, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE).group(1))


def test_a_client_that_leaves_mid_search_frees_the_engine(server):
    """240 steps of 8 beams would be 1920 one-token requests (~1.5 s here); the search stops
    soon after the client leaves."""
    before = _metric(server.url, "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=0.2, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 240, "n": 8, "ignore_eos": True,
            **BEAM})
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (_metric(server.url, "vllm:num_requests_running") == 0
                and _metric(server.url, "vllm:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the search's requests were not aborted")
    time.sleep(0.5)   # a search still running would go on adding steps
    assert 0 < _metric(server.url, "vllm:generation_tokens_total") - before < 960
    assert _metric(server.url, "vllm:num_requests_running") == 0
    assert httpx.get(f"{server.url}/health").status_code == 200

