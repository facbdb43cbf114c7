"""`minivllm serve`'s deployment flags, as vLLM's: TLS, --root-path, --middleware (a class and a
function), --enable-log-requests / --max-log-len, the periodic stats line (--disable-log-stats
turns it off) and --response-role, on a real server over loopback."""

from __future__ import annotations

import logging
import socket
import ssl
import subprocess
import threading
import time

import httpx
import pytest

from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.cli import build_parser
from minivllm.entrypoints.openai.api_server import build_app
from minivllm.entrypoints.openai.server_launch import (check_serve_args,
                                                       configure_logging_and_middleware,
                                                       uvicorn_config)
from minivllm.v1.metrics.loggers import LoggingStatLogger
from tests.conftest import captured_log
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

HERE = "tests.entrypoints.openai.test_server_launch"


class HeaderMiddleware:
    """An ASGI middleware class (`--middleware module:Class`): marks every response."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def marked(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message["headers"], (b"x-class-middleware", b"1")]
            await send(message)
        await self.app(scope, receive, marked if scope["type"] == "http" else send)


async def stamp(request, call_next):
    """An HTTP middleware function (`--middleware module.function`)."""
    response = await call_next(request)
    response.headers["x-function-middleware"] = "1"
    return response


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("launch")))


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (openssl, as an operator would make one)."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = str(folder / "key.pem"), str(folder / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return key, cert


def _serve(checkpoint: str, flags: list[str]):
    """The server `serve` would start with these flags, in a thread; yields (url, async_llm)."""
    args = build_parser().parse_args(["serve", "--model", checkpoint, "--dtype", "float32",
                                      "--max-model-len", "128", "--num-gpu-blocks-override",
                                      "32", "--port", "0", *flags])
    engine_args = EngineArgs.from_cli_args(args)
    chat_template = check_serve_args(args, engine_args)
    async_llm = AsyncLLM.from_engine_args(engine_args)
    app = build_app(async_llm, "tiny", chat_template=chat_template,
                    response_role=args.response_role)
    configure_logging_and_middleware(app, async_llm, args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    import uvicorn

    server = uvicorn.Server(uvicorn_config(app, args))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    scheme = "https" if args.ssl_certfile else "http"
    return f"{scheme}://127.0.0.1:{sock.getsockname()[1]}", async_llm, server, thread


def _stop(server, thread, async_llm) -> None:
    server.should_exit = True
    thread.join(10)
    async_llm.shutdown()


def test_tls_root_path_middleware_request_log_and_role(checkpoint, certificate, monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.01")
    key, cert = certificate
    # `serve` logs at INFO (server_log_level)
    with captured_log("minivllm.entrypoints.logger", logging.INFO) as log:
        url, async_llm, server, thread = _serve(checkpoint, [
            "--ssl-keyfile", key, "--ssl-certfile", cert, "--root-path", "/api",
            "--middleware", f"{HERE}:HeaderMiddleware", "--middleware", f"{HERE}.stamp",
            "--enable-log-requests", "--max-log-len", "3", "--response-role", "bot"])
        try:
            with pytest.raises(httpx.HTTPError):      # TLS only: plain HTTP gets no answer
                httpx.get(url.replace("https", "http") + "/health", timeout=5)
            with httpx.Client(verify=ssl.create_default_context(cafile=cert),
                              timeout=30) as client:
                _use(client, url)
        finally:
            _stop(server, thread, async_llm)
    assert any("prompt_token_ids: [5, 6, 7]," in line and "max_tokens=2" in line
               for line in log), log
    stats = [s for s in async_llm.stat_loggers if isinstance(s, LoggingStatLogger)]
    assert stats and any(line.startswith("Avg prompt throughput: ") and "Running: " in line
                         for line in stats[0].lines)


def _use(client: httpx.Client, url: str) -> None:
    """Health through both middlewares, the root path in the OpenAPI servers, the reply's
    role, and a token-id prompt for the request log."""
    health = client.get(f"{url}/health")
    assert health.status_code == 200
    assert health.headers["x-class-middleware"] == "1"
    assert health.headers["x-function-middleware"] == "1"
    assert client.get(f"{url}/openapi.json").json()["servers"] == [{"url": "/api"}]
    reply = client.post(f"{url}/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert reply.json()["choices"][0]["message"]["role"] == "bot"
    client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8, 9],
                                              "max_tokens": 2})


def test_disable_log_stats_and_flag_errors(checkpoint):
    url, async_llm, server, thread = _serve(checkpoint, ["--disable-log-stats"])
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        assert not any(isinstance(s, LoggingStatLogger) for s in async_llm.stat_loggers)
    finally:
        _stop(server, thread, async_llm)
    for flags, message in ((["--ssl-keyfile", "k.pem"], "needs both --ssl-keyfile and"),
                           (["--root-path", "api"], "must start with '/'"),
                           (["--middleware", "no_such_module:Thing"], "cannot be imported"),
                           (["--max-log-len", "-1"], "must be >= 0")):
        args = build_parser().parse_args(["serve", "--model", checkpoint, *flags])
        with pytest.raises(ValueError, match=message):
            check_serve_args(args, EngineArgs.from_cli_args(args))
