"""--max-logprobs (vLLM's max_logprobs): the engine's bound on logprobs and prompt_logprobs,
20 by default, raised or lifted (-1: the vocabulary) per engine; a request past it is a
ValueError offline and a 400 served, both naming the flag."""

import math

import httpx
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import ServerThread, write_tiny_checkpoint

ARGS = dict(dtype="float32", max_model_len=64, num_gpu_blocks_override=32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("max_logprobs")))


def test_default_bound_is_20(checkpoint):
    llm = LLM(model=checkpoint, **ARGS)
    out = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)
    assert all(len(step) >= 20 for step in out[0].outputs[0].logprobs)
    for params in (SamplingParams(logprobs=21), SamplingParams(prompt_logprobs=21)):
        with pytest.raises(ValueError, match="larger --max-logprobs"):
            llm.generate("Hello", params, use_tqdm=False)


def test_a_raised_bound_and_the_whole_vocabulary(checkpoint):
    llm = LLM(model=checkpoint, max_logprobs=30, **ARGS)
    out = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=25, prompt_logprobs=25),
                       use_tqdm=False)[0]
    assert all(len(step) >= 25 for step in out.outputs[0].logprobs)
    assert all(len(step) >= 25 for step in out.prompt_logprobs[1:])
    whole = LLM(model=checkpoint, max_logprobs=-1, **ARGS)
    vocab = whole.llm_engine.vocab_size
    step = whole.generate("Hello", SamplingParams(max_tokens=1, logprobs=vocab),
                          use_tqdm=False)[0].outputs[0].logprobs[0]
    assert len(step) == vocab
    assert math.isclose(sum(math.exp(lp.logprob) for lp in step.values()), 1.0, rel_tol=1e-4)


def test_served_requests_past_the_bound_get_a_400(checkpoint):
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model=checkpoint, **ARGS))
    try:
        with ServerThread(build_app(async_llm, "tiny")) as server:
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 2, "logprobs": True}
            ok = httpx.post(f"{server.url}/v1/chat/completions",
                            json={**chat, "top_logprobs": 20}, timeout=60)
            too_many = httpx.post(f"{server.url}/v1/chat/completions",
                                  json={**chat, "top_logprobs": 21}, timeout=60)
            assert ok.status_code == 200
            assert too_many.status_code == 400
            error = too_many.json()["error"]
            assert "--max-logprobs" in error["message"] and error["param"] == "top_logprobs"
    finally:
        async_llm.shutdown()
