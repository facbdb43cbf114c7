"""The OpenAI-compatible server end to end: a real uvicorn on a loopback port, the openai client."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import ServerThread, write_tiny_checkpoint

MODEL = "tiny"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello world, how are you today?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_server")))


@contextmanager
def running_server(checkpoint: str, app_kwargs: dict | None = None,
                   engine_kwargs: dict | None = None, **kwargs):
    """A real server for `checkpoint` (fp32, a small KV cache: a RAM-sized one takes seconds to
    allocate); `app_kwargs` go to build_app, `engine_kwargs` to the engine, the rest to AsyncLLM."""
    engine_args = EngineArgs(**{"model": checkpoint, "dtype": "float32", "max_model_len": 512,
                                "num_gpu_blocks_override": 256, "max_num_seqs": 64,
                                "max_num_queued_requests": 1024, **(engine_kwargs or {})})
    async_llm = AsyncLLM.from_engine_args(engine_args, **kwargs)
    with ServerThread(build_app(async_llm, MODEL, **(app_kwargs or {}))) as server:
        server.async_llm = async_llm
        yield server
    async_llm.shutdown()


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(checkpoint) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def wait_until_idle(url: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (metric(url, "vllm:num_requests_running") == 0
                and metric(url, "vllm:num_requests_waiting") == 0
                and metric(url, "vllm:kv_cache_usage_perc") == 0):
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not go back to idle (requests or KV blocks leaked)")


def test_models_version_health_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 512
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == PROMPT
    chat_ids = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert chat_ids[0] == 1   # the template's <s>


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert full.usage.prompt_tokens > 0 and full.usage.total_tokens == \
        full.usage.prompt_tokens + full.usage.completion_tokens


def test_completion_length_usage_and_token_prompts(server, client):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    out = client.completions.create(prompt=[PROMPT, "Hello world"], **kwargs)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 12
    by_ids = client.completions.create(prompt=[ids], **kwargs)   # a batch of token-id prompts
    assert by_ids.choices[0].text == out.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    assert client.completions.create(prompt=ids, **kwargs).choices[0].text == out.choices[0].text


def test_completion_n2_seed_and_extras(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=7,
                  extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]   # seeded
    assert first.usage.completion_tokens == 16
    chunks = list(client.completions.create(**kwargs, stream=True))
    for index in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == index) == \
            first.choices[index].text


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0.0,
                                    logprobs=3, echo=True, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) \
        == out.usage.prompt_tokens + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # nothing predicts it
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    # Top-3 plus the chosen token, keyed by text (byte tokens that all print as U+FFFD collide).
    assert all(1 <= len(top) <= 4 and top[token] <= 0
               for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # Greedy: the chosen token is the most likely one.
    for logprob, top in list(zip(lp.token_logprobs, lp.top_logprobs))[-5:]:
        assert logprob >= max(top.values()) - 1e-4


def test_chat_stream_equals_non_stream_with_logprobs(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=12, temperature=0.0,
                  logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.role == "assistant"
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.bytes is not None for entry in content)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    streamed_lp = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed_lp] == [e.token for e in content]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_n2_and_max_tokens(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2,
                                         temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 8


def test_stop_strings_streamed_and_not(client):
    base = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.0,
                extra_body={"ignore_eos": True})
    greedy = client.completions.create(**base, logprobs=0).choices[0]
    text, tokens = greedy.text, greedy.logprobs.tokens
    # A stop string across a token boundary: its first character arrives one token before the
    # rest, so the stream must hold it back rather than send it and be unable to take it back.
    plain = [bool(t) and t.isascii() and t.isprintable() for t in tokens]
    k = next(k for k in range(2, len(tokens) - 1) if plain[k] and plain[k + 1])
    stop = tokens[k][-1] + tokens[k + 1][0]
    expected = text[:text.index(stop)]
    out = client.completions.create(**base, stop=[stop, "never-appears"])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**base, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_50_concurrent_streams(server):
    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=8, temperature=0.8, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage, finish, num_chunks = None, None, 0
        async for chunk in stream:
            if chunk.choices:
                num_chunks += 1
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return usage.completion_tokens, num_chunks, finish

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(50)))
        finally:
            await aclient.close()

    peak_running, done = [0], threading.Event()

    def watch() -> None:   # the requests must share engine steps (continuous batching)
        while not done.is_set():
            peak_running[0] = max(peak_running[0], server.async_llm.stats.num_running)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(main())
    finally:
        done.set()
        watcher.join()
    assert all(tokens == 8 and finish == "length" and 1 <= chunks <= 8
               for tokens, chunks, finish in results), results
    assert peak_running[0] > 10
    wait_until_idle(server.url)


def test_disconnects_abort_and_free_blocks(server):
    # 480 new tokens (the prompt's 5 fill the 512-token context): ~0.3 s on the 2-core box, and
    # at least one engine step each; an aborted request stops short of them.
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=480, ignore_eos=True, stream=True)
    generated = lambda: metric(server.url, "vllm:generation_tokens_total")  # noqa: E731
    with httpx.Client(base_url=server.url, timeout=30) as http:
        before = generated()
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert metric(server.url, "vllm:num_requests_running") == 1
            assert metric(server.url, "vllm:kv_cache_usage_perc") > 0
        # Closed mid-stream: the request must be aborted and its blocks freed.
        wait_until_idle(server.url)
        assert 0 < generated() - before < 480
        # A non-streaming request whose client gives up is aborted as well.
        before = generated()
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**body, "stream": False}, timeout=0.05)
        wait_until_idle(server.url)
        assert generated() - before < 480
    assert metric(server.url, "vllm:generation_tokens_total") > 0
    assert metric(server.url, "vllm:time_to_first_token_seconds_count") > 0


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": ["x", "y"], "n": 600}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": [5000]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 600}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 500, "max_tokens": 20}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
])
def test_invalid_inputs_give_openai_errors(server, path, body, status, param):
    response = httpx.post(f"{server.url}{path}", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert error["param"] == param
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client):
    """A prompt past max_model_len (512) runs on its last k tokens: the same completion."""
    long = [5, 6, 7] * 200
    kept = client.completions.create(model=MODEL, prompt=long, max_tokens=6, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 30})
    tail = client.completions.create(model=MODEL, prompt=long[-30:], max_tokens=6, temperature=0)
    assert kept.usage.prompt_tokens == 30 and kept.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_error_messages_and_malformed_json(server, client):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [5] * 600})
    assert "512" in response.json()["error"]["message"] and "600" in response.json()["error"]["message"]
    response = httpx.post(f"{server.url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == 400
    response = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "tiny", '
                          b'"prompt": "x", "temperature": NaN}',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10_000)


def test_bench_serve_against_the_server(server, capsys):
    import argparse

    from minivllm.benchmarks.serve import add_serve_bench_args, run_serve_bench

    args = add_serve_bench_args(argparse.ArgumentParser()).parse_args(
        ["--base-url", server.url, "--num-prompts", "4", "--max-concurrency", "2",
         "--input-len", "8", "--output-len", "4"])
    result = run_serve_bench(args)
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 16 and result["total_input_tokens"] == 32
    assert result["mean_ttft_ms"] > 0 and result["p99_itl_ms"] >= result["p50_itl_ms"]
    assert "Mean TTFT (ms)" in capsys.readouterr().out


def test_full_queue_429_then_stopped_loop_503(checkpoint):
    with running_server(checkpoint, engine_kwargs={"max_num_seqs": 1,
                                                   "max_num_queued_requests": 2}) as server:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 150, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body)
                                              for _ in range(8)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
        rejected = next(r for r in responses if r.status_code == 429)
        assert int(rejected.headers["Retry-After"]) >= 1
        assert rejected.json()["error"]["code"] == 429
        # A request in flight when the loop stops ends with an error, it does not hang.
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions",
                             json={**body, "max_tokens": 400, "stream": True}) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                server.async_llm.stop()
                rest = [line for line in lines if line.startswith("data: ")]
            assert '"code":503' in rest[-2] and rest[-1] == "data: [DONE]"
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == 503
            assert http.post("/v1/completions", json=body).status_code == 503


def test_engine_stall_and_crash_mark_health(checkpoint):
    with running_server(checkpoint, stall_timeout_s=0.3) as server:
        engine = server.async_llm.engine
        real_step = engine.step

        def slow_step():
            time.sleep(0.8)
            return real_step()

        engine.step = slow_step
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions",
                             json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True}):
                time.sleep(0.5)
                assert http.get("/health").status_code == 503   # work waiting, no progress
            engine.step = real_step
            wait_until_idle(server.url)
            assert http.get("/health").status_code == 200

            def broken_step():
                raise RuntimeError("simulated kernel failure")

            engine.step = broken_step
            response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT})
            assert response.status_code == 503
            assert "simulated kernel failure" in response.json()["error"]["message"]
            assert http.get("/health").status_code == 503


def test_serve_cli_parses_engine_flags():
    from minivllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "9001", "--max-model-len", "64",
                                      "--served-model-name", "m", "--max-num-queued-requests", "3"])
    assert (args.host, args.port, args.served_model_name) == ("127.0.0.1", 9001, ["m"])
    assert args.max_model_len == 64 and args.max_num_queued_requests == 3
    assert args.func.__name__ == "cmd_serve"
