"""vLLM's extras on completions and chat: stream_options.continuous_usage_stats,
return_token_ids, the priority field and --enable-prompt-tokens-details (tiny checkpoint behind
the shared server fixture)."""

import base64
import io

import httpx
import torch

from tests.entrypoints.openai._helpers import openai_client
from tests.entrypoints.openai.test_api_server import (MESSAGES, MODEL, PROMPT,  # noqa: F401
                                                      checkpoint, client, running_server,
                                                      server)


def test_continuous_usage_stats_count_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    for chunks in (list(client.completions.create(prompt=[PROMPT, "Hello world"], stream=True,
                                                  stream_options=opts, **kwargs)),
                   list(client.chat.completions.create(messages=MESSAGES, n=2, stream=True,
                                                       stream_options=opts, **kwargs))):
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 3
        assert chunks[-1].choices == [] and chunks[-1].usage == chunks[-2].usage
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
                   for c in chunks)
    plain = list(client.completions.create(prompt=PROMPT, stream=True, **kwargs))
    assert all(c.usage is None for c in plain)


def test_return_token_ids_streamed_and_not(server, client):
    """vLLM's return_token_ids: the prompt's ids and each choice's, which decode to its text."""
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0.0, n=2, seed=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    chat_ids = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    whole = client.completions.create(prompt=PROMPT, **kwargs)
    chat = client.chat.completions.create(messages=MESSAGES, **kwargs)
    assert chat.model_extra["prompt_token_ids"] == chat_ids
    for choice in whole.choices:
        assert choice.model_extra["prompt_token_ids"] == ids
        assert len(choice.model_extra["token_ids"]) == 8
    assert all(len(c.model_extra["token_ids"]) == 8 for c in chat.choices)
    for name, chunks, full in (
            ("completions", client.completions.create(prompt=PROMPT, stream=True, **kwargs), whole),
            ("chat", client.chat.completions.create(messages=MESSAGES, stream=True, **kwargs), chat)):
        streamed, prompts = {0: [], 1: []}, []
        for chunk in chunks:
            prompts += [chunk.model_extra.get("prompt_token_ids")]
            for c in chunk.choices:
                streamed[c.index] += c.model_extra.get("token_ids") or []
                prompts += [c.model_extra.get("prompt_token_ids")]
        assert [streamed[c.index] for c in full.choices] == [c.model_extra["token_ids"]
                                                           for c in full.choices], name
        sent = [p for p in prompts if p is not None]
        assert sent == ([ids, ids] if name == "completions" else [chat_ids]), name
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].model_extra["token_ids"] is None


def test_priority_needs_priority_scheduling(server):
    for route, body in (("/v1/completions", {"prompt": PROMPT}),
                        ("/v1/chat/completions", {"messages": MESSAGES})):
        r = httpx.post(f"{server.url}{route}", json={"model": MODEL, "max_tokens": 2,
                                                     "priority": 3, **body})
        assert r.status_code == 400 and "--scheduling-policy priority" in r.text
        ok = httpx.post(f"{server.url}{route}", json={"model": MODEL, "max_tokens": 2,
                                                      "priority": 0, **body})
        assert ok.status_code == 200


def test_prompt_tokens_details_report_the_prefix_cache(checkpoint, client):
    prompt = " ".join([PROMPT] * 12)   # several full blocks of 16 tokens
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2)
    assert client.completions.create(**kwargs).usage.prompt_tokens_details is None   # flag off
    with running_server(checkpoint, {"enable_prompt_tokens_details": True}) as detailed:
        c = openai_client(detailed)
        first = c.completions.create(**kwargs).usage
        again = c.completions.create(**kwargs).usage
        streamed = [ch.usage for ch in c.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs) if ch.usage][-1]
        chat = [c.chat.completions.create(model=MODEL, max_tokens=2,
                                          messages=[{"role": "user", "content": prompt}]).usage
                for _ in range(2)]
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = again.prompt_tokens_details.cached_tokens
    assert 16 <= cached < again.prompt_tokens and cached % 16 == 0
    assert streamed.prompt_tokens_details.cached_tokens == cached
    assert chat[0].prompt_tokens_details.cached_tokens == 0
    assert chat[1].prompt_tokens_details.cached_tokens >= 16


def test_tokenize_renders_tools_as_chat_does(server, client):
    template = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"model": MODEL, "messages": MESSAGES, "chat_template": template}
    with_tools = httpx.post(f"{server.url}/tokenize", json={**body, "tools": tools}).json()
    without = httpx.post(f"{server.url}/tokenize", json=body).json()
    assert with_tools["count"] > without["count"] + 10
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools,
                                          tool_choice="none", max_tokens=1,
                                          extra_body={"chat_template": template})
    assert chat.usage.prompt_tokens == with_tools["count"]
    bad = httpx.post(f"{server.url}/tokenize", json={**body, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def test_prompt_embeds_need_the_flag(server):
    buffer = io.BytesIO()
    torch.save(torch.zeros(2, 4), buffer)
    r = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL, "max_tokens": 2, "prompt_embeds": base64.b64encode(buffer.getvalue()).decode()})
    assert r.status_code == 400 and "--enable-prompt-embeds" in r.json()["error"]["message"]
