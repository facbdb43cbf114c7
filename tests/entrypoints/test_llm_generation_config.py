"""The checkpoint's generation_config.json, as vLLM reads it: its sampling values are the defaults
of requests that set none (offline and served), its extra eos ids stop generation, and
--generation-config vllm / override_generation_config change the defaults (tiny checkpoint)."""

from __future__ import annotations

import httpx
import pytest
from transformers import GenerationConfig

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import serve, write_tiny_checkpoint

PROMPT = "The quick brown fox"
KWARGS = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=32)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    folder = write_tiny_checkpoint(str(tmp_path_factory.mktemp("gen_config")))
    # top_k 1 makes any temperature greedy; max_new_tokens the default length.
    GenerationConfig(top_k=1, temperature=0.9, max_new_tokens=6, eos_token_id=2,
                     do_sample=True).save_pretrained(folder)
    return folder


def test_offline_defaults_come_from_the_generation_config(path):
    llm = LLM(path, **KWARGS)
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature, defaults.max_tokens) == (1, 0.9, 6)
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    for seed in range(3):   # no params: the defaults, so greedy whatever the seed
        out = llm.generate([PROMPT])[0].outputs[0]
        assert out.token_ids == greedy.token_ids and len(out.token_ids) == 6
    llm.shutdown()
    plain = LLM(path, generation_config="vllm", **KWARGS)
    assert plain.get_default_sampling_params().top_k == 0
    plain.shutdown()
    override = LLM(path, override_generation_config={"max_new_tokens": 3}, **KWARGS)
    assert override.get_default_sampling_params().max_tokens == 3
    override.shutdown()


def test_extra_eos_ids_of_the_generation_config_stop_generation(path, tmp_path):
    llm = LLM(path, generation_config="vllm", **KWARGS)
    params = SamplingParams(temperature=0, max_tokens=8)
    tokens = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    llm.shutdown()
    stop_at = next(i for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i] and t != 2)
    other = tmp_path / "other"
    other.mkdir()
    GenerationConfig(eos_token_id=[2, tokens[stop_at]]).save_pretrained(str(other))
    llm = LLM(path, generation_config=str(other), **KWARGS)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == tokens[:stop_at + 1] and out.finish_reason == "stop"
    assert out.stop_reason == tokens[stop_at]
    assert llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
                        )[0].outputs[0].token_ids == tokens
    llm.shutdown()
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        LLM(path, generation_config=str(tmp_path), **KWARGS)


def test_served_requests_inherit_the_defaults(path):
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model=path, **KWARGS))
    with serve(async_llm, build_app(async_llm, "tiny")) as server:
        def complete(**body):
            r = httpx.post(f"{server.url}/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]
        texts = {complete(seed=seed)["message"]["content"] for seed in range(3)}
        sampled = {complete(seed=seed, top_k=0, temperature=1.0)["message"]["content"]
                   for seed in range(3)}
        default_length = complete()
    assert len(texts) == 1 and len(sampled) > 1   # top_k 1 came from the generation config
    assert default_length["finish_reason"] == "length"   # max_new_tokens: 6
