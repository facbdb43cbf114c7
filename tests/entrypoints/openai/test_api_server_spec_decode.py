"""A server that speculates (n-gram drafts) answers as one that does not, streamed or not,
and reports vLLM's speculative-decoding counters on /metrics."""

import httpx
import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import ServerThread, write_tiny_checkpoint
from tests.entrypoints.openai.test_api_server import metric

MODEL = "tiny"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the"
ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("spec_server")))


@pytest.fixture(scope="module")
def server(checkpoint):
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model=checkpoint, speculative_config=SPEC,
                                                     **ARGS))
    with ServerThread(build_app(async_llm, MODEL)) as server:
        yield server
    async_llm.shutdown()


def test_completions_streamed_and_whole_equal_decoding_without_drafts(server, checkpoint):
    expected = LLM(model=checkpoint, **ARGS).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].text == expected.text
    assert whole.choices[0].model_extra["token_ids"] == list(expected.token_ids)
    assert whole.usage.completion_tokens == 40
    chunks = list(client.completions.create(stream=True, **kwargs))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == expected.text
    # A verified step yields several tokens at once: fewer chunks than tokens.
    assert len(pieces) < 40


def test_metrics_count_drafts_and_acceptances(server):
    drafts = metric(server.url, "vllm:spec_decode_num_drafts_total")
    drafted = metric(server.url, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(server.url, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted and drafts > 0
    text = httpx.get(f"{server.url}/metrics").text
    per_pos = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert len(per_pos) == 3 and sum(per_pos) == accepted
