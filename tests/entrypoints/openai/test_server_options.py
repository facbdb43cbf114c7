"""`--api-key` / VLLM_API_KEY, `--chat-template` and the CORS flags on a real server with the
openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from minivllm.entrypoints.cli import build_parser
from minivllm.entrypoints.openai.server_options import (CORSOptions, load_chat_template,
                                                        resolve_api_keys)
from tests.entrypoints.openai._helpers import make_tokenizer, write_tiny_checkpoint
from tests.entrypoints.openai.test_api_server import running_server

MODEL = "tiny"   # test_api_server's served name
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}reply:"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_options")))


def server_with(checkpoint: str, **app_kwargs):
    return running_server(checkpoint, app_kwargs)


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_v1_routes_need_one_of_the_keys(checkpoint, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with server_with(checkpoint, api_keys=["first-key", "second-key"]) as server:
        with pytest.raises(openai.AuthenticationError):
            client(server, "wrong").completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        bare = httpx.get(f"{server.url}/v1/models")
        assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
        assert bare.json()["error"]["code"] == 401 and "API key" in bare.json()["error"]["message"]
        for key in ("first-key", "second-key"):
            done = client(server, key).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
            assert done.usage.completion_tokens == 2
        streamed = client(server, "second-key").completions.create(
            model=MODEL, prompt="Hello", max_tokens=3, stream=True)
        assert len([c for c in streamed if c.choices and c.choices[0].text]) >= 1
        # outside /v1 stays open, as in vLLM
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello"}).status_code == 200


def test_vllm_api_key_applies_when_no_key_is_given(checkpoint, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    with server_with(checkpoint) as server:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert [m.id for m in client(server, "from-env").models.list()] == [MODEL]
    monkeypatch.delenv("VLLM_API_KEY")
    assert resolve_api_keys(None, None) == []
    assert resolve_api_keys(["a"], "from-env") == ["a"]
    with pytest.raises(ValueError, match="non-empty keys"):
        resolve_api_keys([""], None)


def test_chat_template_replaces_the_tokenizers(checkpoint, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(TEMPLATE)
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    messages = [{"role": "user", "content": "Hello world"}]
    expected = make_tokenizer().encode("[user] Hello world\nreply:", add_special_tokens=False)
    with server_with(checkpoint, chat_template=load_chat_template(str(path))) as server:
        got = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
        assert got == expected
        chat = client(server, "unused").chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2)
        assert chat.usage.prompt_tokens == len(expected)
        # a request's own template still wins
        own = httpx.post(f"{server.url}/tokenize", json={
            "messages": messages, "chat_template": "{{ messages[0]['content'] }}"}).json()
        assert own["tokens"] == make_tokenizer().encode("Hello world", add_special_tokens=False)


def test_serve_parses_the_vllm_flags():
    args = build_parser().parse_args(["serve", "--api-key", "a", "b", "--chat-template", "t.jinja",
                                      "--disable-uvicorn-access-log"])
    assert args.api_key == ["a", "b"] and args.chat_template == "t.jinja"
    assert args.disable_uvicorn_access_log


def test_a_port_in_use_fails_before_the_model_loads(checkpoint, monkeypatch):
    """`serve` binds its port first (as vLLM does): a port in use is a ValueError naming it,
    without building the engine."""
    import socket

    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.openai.api_server import run_server

    def no_engine(*_, **__):
        raise AssertionError("the engine was built before the port was checked")
    monkeypatch.setattr(AsyncLLM, "from_engine_args", no_engine)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = build_parser().parse_args(["serve", "--model", checkpoint, "--port", str(port)])
        with pytest.raises(ValueError, match=f"Cannot listen on 127.0.0.1:{port}: .*pick another "
                                             "--port"):
            run_server(args)


PREFLIGHT = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_cors_lets_browser_pages_call_the_server(checkpoint, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with server_with(checkpoint, api_keys=["k"]) as server:   # vLLM's default: any origin
        url = f"{server.url}/v1/completions"
        preflight = httpx.options(url, headers=PREFLIGHT)   # no key: answered before the check
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        done = httpx.post(url, headers={"Origin": "http://ui.example", "Authorization": "Bearer k"},
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert done.status_code == 200 and done.headers["access-control-allow-origin"] == "*"
    only = CORSOptions(allowed_origins=["http://ui.example"])
    with server_with(checkpoint, cors=only) as server:
        url = f"{server.url}/v1/completions"
        ok = httpx.options(url, headers=PREFLIGHT)
        other = httpx.options(url, headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert ok.headers["access-control-allow-origin"] == "http://ui.example"
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_cors_flags_parse_json_lists():
    args = build_parser().parse_args(["serve", "--allowed-origins", '["http://a.example"]'])
    assert args.allowed_origins == ["http://a.example"] and args.allowed_methods == ["*"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "http://a.example"])
