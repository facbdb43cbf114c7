"""The server's structured outputs, tool calls, logit_bias and the stress test's findings, on the default
model (a real tokenizer) behind a real uvicorn on loopback, with the openai client."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import jsonschema
import openai
import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.api_server import build_app
from tests.entrypoints.openai._helpers import openai_client, serve

MODEL = "default"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    """The default model with hermes tool calls (also the tools and /v1/responses tests'
    server: it stores responses)."""
    engine_args = EngineArgs(max_model_len=512, num_gpu_blocks_override=128, max_num_seqs=32)
    async_llm = AsyncLLM.from_engine_args(engine_args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
        app = build_app(async_llm, MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve(async_llm, app) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def _gather(server, calls):
    """Runs coroutine factories concurrently (so they share engine steps)."""
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(call(client) for call in calls))
    return asyncio.run(run())


def test_json_schema_strict_20_seeded_requests_validate(server):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def call(seed):
        return lambda c: c.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=48,
            response_format=response_format)
    responses = _gather(server, [call(seed) for seed in range(20)])
    strict = {**SCHEMA, "additionalProperties": False}
    for r in responses:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), strict)


def test_json_object_regex_choice_and_free_requests_in_one_batch(server, client):
    # Free greedy requests, 4 tokens: a constrained row's bitmask leaking into them would show at
    # once; later tokens of this prompt are near ties that the step's prompt rows can tip (on
    # AVX2 CPUs prompt chunks of 64+ rows multiply fp32 tiles, shorter ones bf16 tiles).
    def free(c):
        return c.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4)
    constrained = [
        lambda c: c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0,
                                            seed=1, max_tokens=96,
                                            response_format={"type": "json_object"}),
        lambda c: c.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, seed=2,
                                       max_tokens=12, extra_body={"structured_outputs": {
                                           "regex": r" [A-Z][a-z]{2,6}\."}}),
        lambda c: c.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, seed=3,
                                       max_tokens=12, n=2, extra_body={"structured_outputs": {
                                           "choice": [" Paris", " Lyon", " Nice"]}}),
        lambda c: c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0,
                                            seed=4, max_tokens=12, extra_body={
                                                "structured_outputs": {"grammar": 'start: "age=" /[0-9]{2}/'}}),
    ]
    alone = free(client).choices[0].text
    results = _gather(server, [free, constrained[0], free, constrained[1], free, constrained[2],
                               free, constrained[3]])
    assert [results[i].choices[0].text for i in (0, 2, 4, 6)] == [alone] * 4
    # (sampled at temperature 1 the object may still run past max_tokens, whitespace and all:
    # then it is cut, as in vLLM, and must at least have started as an object)
    obj = results[1].choices[0]
    if obj.finish_reason == "length":
        assert obj.message.content.lstrip().startswith("{")
        assert results[1].usage.completion_tokens == 96
    else:
        assert isinstance(json.loads(obj.message.content), dict)
    assert re.fullmatch(r" [A-Z][a-z]{2,6}\.", results[3].choices[0].text)
    assert len(results[5].choices) == 2
    assert {c.text for c in results[5].choices} <= {" Paris", " Lyon", " Nice"}
    assert re.fullmatch(r"age=[0-9]{2}", results[7].choices[0].message.content)


def _read_response(stream) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response with a Content-Length, read off a socket file."""
    status_line = stream.readline()
    assert status_line, "the server closed the connection"
    headers = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), stream.read(int(headers.get("content-length", 0)))


def test_an_internal_error_is_a_500_that_keeps_the_connection(server, monkeypatch):
    """An unexpected exception in a route answers the OpenAI-shaped 500, and the keep-alive
    connection serves the next request: raised on to uvicorn, it closed the connection after
    the response, and a client's next request on it was reset."""
    from minivllm.entrypoints.openai import api_server

    def broken(*_):
        raise RuntimeError("boom")
    monkeypatch.setattr(api_server, "check_generate_runner", broken)
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        stream = sock.makefile("rb")
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        status, payload = _read_response(stream)
        assert status == 500
        error = json.loads(payload)["error"]
        assert error["code"] == 500 and "RuntimeError: boom" in error["message"]
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _read_response(stream)[0] == 200


@pytest.mark.parametrize("body, param, problem", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, "response_format", "no-such-type"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"no_such": 1}}, "structured_outputs", "no_such"),
    # a JSON value of the wrong type reached the grammar library (TypeError: a 500)
    ({"structured_outputs": {"regex": 5}}, "structured_outputs", "regex must be a string"),
    ({"structured_outputs": {"grammar": ["x"]}}, "structured_outputs", "grammar must be a string"),
    ({"structured_outputs": {"json": True}}, "structured_outputs", "string or an object"),
    ({"tools": [{"type": "function", "function": {}}],
      "tool_choice": {"type": "function", "function": {}}}, "tools", "name must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}, "tools",
     "parameters must be"),
    ({"tools": [{"type": "retrieval"}]}, "tools", 'tools[0] must be {"type": "function"'),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "out of range"),
    ({"logit_bias": {"abc": 5}}, "logit_bias", "token ids"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids", "out of range"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
])
def test_bad_constraints_and_options_are_400s_naming_the_problem(server, body, param, problem):
    paths = (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": MESSAGES}))
    for path, base in paths[1:] if "tools" in body else paths:
        r = httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, "max_tokens": 4, **base, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert problem in error["message"] and error["param"] == param


def test_logit_bias_bans_and_forces_a_token(server, client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=1)
    token = httpx.post(f"{server.url}/tokenize", json={"prompt": greedy.choices[0].text,
                                                       "add_special_tokens": False}).json()["tokens"]
    assert len(token) == 1
    banned = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=1,
                                       logit_bias={str(token[0]): -100})
    assert banned.choices[0].text != greedy.choices[0].text
    forced_id = httpx.post(f"{server.url}/tokenize", json={"prompt": " banana",
                                                           "add_special_tokens": False}).json()["tokens"]
    forced = client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, max_tokens=3,
                                       logit_bias={str(forced_id[0]): 100})
    piece = httpx.post(f"{server.url}/detokenize", json={"tokens": forced_id[:1]}).json()["prompt"]
    assert forced.choices[0].text == piece * 3
    allowed = client.completions.create(model=MODEL, prompt=PROMPT, temperature=1.0, max_tokens=3,
                                        extra_body={"allowed_token_ids": forced_id[:1]})
    assert allowed.choices[0].text == piece * 3


def test_bad_words_streamed_and_not(server, client):
    """The greedy first word, banned (vLLM's `bad_words` extra), is not generated, with and
    without streaming and on chat; a blank word is a 400 naming the field."""
    free = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=6)
    word = free.choices[0].text.split()[0]
    body = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=6,
                extra_body={"bad_words": [word]})
    text = client.completions.create(**body).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True)
                       if c.choices)
    assert text == streamed and text.split()[:1] != [word] and word not in text.split()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          max_tokens=6).choices[0].message.content
    chat_word = chat.split()[0]
    banned = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                            max_tokens=6, extra_body={"bad_words": [chat_word]})
    assert chat_word not in banned.choices[0].message.content.split()
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL, "prompt": PROMPT, "bad_words": [" "]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"


@pytest.mark.parametrize("path, body", [
    ("completions", '{"model": "\\ud800", "prompt": "hi"}'),
    ("completions", '{"prompt": "hi \\udfff there"}'),
    ("completions", '{"prompt": ["ok", "\\ud83d"]}'),
    ("completions", '{"prompt": "hi", "stop": ["\\ud800"]}'),
    ("chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}'),
    ("chat/completions", '{"messages": [{"role": "user", "content": "x"}], "user": "\\ud800"}'),
])
def test_lone_surrogates_are_400_not_500(server, path, body):
    r = httpx.post(f"{server.url}/v1/{path}", content=body,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "lone surrogate" in r.json()["error"]["message"]
    # The connection survives: the server still answers.
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_wrong_content_type_and_invalid_json_say_so(server):
    r = httpx.post(f"{server.url}/v1/completions", content='{"prompt": "hi"}',
                   headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and "Content-Type" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", content='{"prompt": "hi",}',
                   headers={"Content-Type": "application/json"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "not valid JSON" in message and "position 16" in message


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    choice = r.choices[0]
    num_prompt = r.usage.prompt_tokens
    assert choice.text == PROMPT and r.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == num_prompt
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)


def _aborted(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$',
                      text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_client_disconnect_counts_as_abort(server, client):
    before = _aborted(server.url)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while _aborted(server.url) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server.url) == before + 1


def test_chat_template_kwargs_and_continue_final_message(server, client):
    """vLLM's chat options on /v1/chat/completions and /tokenize: extra template variables
    (Qwen3's enable_thinking, here a template that reads it) and a continued assistant turn."""
    template = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    body = {"model": MODEL, "messages": MESSAGES, "chat_template": template,
            "add_generation_prompt": False, "return_token_strs": False}
    plain = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    thinking_off = httpx.post(f"{server.url}/tokenize", json={
        **body, "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    detok = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": thinking_off})
    assert detok.json()["prompt"].startswith("/no_think user:") and thinking_off != plain
    partial = MESSAGES + [{"role": "assistant", "content": "Name: Ann, age:"}]
    continued = client.chat.completions.create(
        model=MODEL, messages=partial, max_tokens=4, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={
        "model": MODEL, "messages": partial, "add_generation_prompt": False,
        "continue_final_message": True}).json()["tokens"]
    assert continued.usage.prompt_tokens == len(prompt_ids)
    prompt = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": prompt_ids})
    assert prompt.json()["prompt"].endswith("Name: Ann, age:")
    for extra, param in [({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs")]:
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": MODEL, "messages": partial, "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_prompt_logprobs_agree_with_echoed_logprobs(server):
    """vLLM's `prompt_logprobs`: per prompt position (None first) the prompt token's logprob and
    rank and the top-k, the same numbers echo + logprobs gives for the prompt."""
    url, k = f"{server.url}/v1/completions", 2
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    r = httpx.post(url, json={**base, "prompt_logprobs": k}).json()
    entries = r["choices"][0]["prompt_logprobs"]
    echo = httpx.post(url, json={**base, "echo": True, "logprobs": k}).json()
    echoed = echo["choices"][0]["logprobs"]
    num_prompt = r["usage"]["prompt_tokens"]
    assert len(entries) == num_prompt and entries[0] is None
    ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    for position in range(1, num_prompt):
        step, token = entries[position], str(ids["tokens"][position])
        assert step[token]["logprob"] == pytest.approx(echoed["token_logprobs"][position], abs=1e-4)
        # both: the top k and the prompt token itself
        assert {e["decoded_token"] for e in step.values()} == \
            echoed["top_logprobs"][position].keys()
        assert sorted(e["rank"] for e in step.values())[:k] == list(range(1, k + 1))
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(step) == 1 for step in chat["prompt_logprobs"][1:])   # k=0: the token alone
    for extra in ({"stream": True}, {"echo": True, "logprobs": 1}):
        bad = httpx.post(url, json={**base, "prompt_logprobs": 1, **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
