"""Deployment options of `minivllm serve` as vLLM names them: `--api-key` (or VLLM_API_KEY),
`--chat-template` (a file, or the template itself), the CORS settings (`--allowed-origins`,
...), so a browser page on another origin may call the server, and
`--enable-request-id-headers`."""

from __future__ import annotations

import hmac
import json
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from minivllm.entrypoints.openai.serving_engine import error_response

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]],
                   Awaitable[None]]


class APIKeyMiddleware:
    """Requests under /v1 must send `Authorization: Bearer <one of the keys>` (or Anthropic's
    `x-api-key: <key>`), else a 401 in OpenAI's error shape (the openai client raises
    AuthenticationError). /health, /metrics,
    /version and the tokenizer routes stay open, as in vLLM.

    A pure ASGI wrapper: streamed responses pass through untouched (no per-chunk cost)."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self._accepted = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or not scope["path"].startswith("/v1")
                or scope.get("method") == "OPTIONS" or self._authorized(scope)):
            return await self.app(scope, receive, send)
        body = json.dumps(error_response("Invalid or missing API key: send the header "
                                         "'Authorization: Bearer <key>'.",
                                         HTTPStatus.UNAUTHORIZED).model_dump()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: dict) -> bool:
        headers = dict(scope.get("headers", ()))
        bearer = headers.get(b"authorization", b"")
        # Anthropic's clients send the key as `x-api-key` (/v1/messages).
        anthropic = b"Bearer " + headers[b"x-api-key"] if b"x-api-key" in headers else b""
        # compare_digest: the time taken does not tell how much of a key matched
        return any(hmac.compare_digest(header, accepted) for accepted in self._accepted
                   for header in (bearer, anthropic))


class RequestIdHeaderMiddleware:
    """vLLM's --enable-request-id-headers: every HTTP response carries `X-Request-Id`, the one
    the request sent, else a new one (the id a completion's body gets from the same header:
    `OpenAIServing.base_request_id`). Pure ASGI, like APIKeyMiddleware."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), b"")
        request_id = sent or uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)
        await self.app(scope, receive, send_with_id)


@dataclass
class CORSOptions:
    """vLLM's defaults: any origin, method and header; no credentials."""
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])

    def middleware_kwargs(self) -> dict[str, Any]:
        return {"allow_origins": self.allowed_origins, "allow_credentials": self.allow_credentials,
                "allow_methods": self.allowed_methods, "allow_headers": self.allowed_headers}


def resolve_api_keys(api_keys: list[str] | None, env_key: str | None) -> list[str]:
    """--api-key's keys, else VLLM_API_KEY's; empty: the server is open."""
    keys = list(api_keys) if api_keys is not None else ([env_key] if env_key else [])
    if any(not key.strip() for key in keys):
        raise ValueError("--api-key needs non-empty keys (or leave it out for an open server).")
    return keys


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a path to a Jinja file, or the template text itself (a value with
    template syntax is the template; anything else must be a readable file)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template "
                     "(one with '{{ ... }}' or '{% ... %}').")


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (as vLLM binds early): a port in use
    is a ValueError at once, not after a minute of loading; port 0 takes a free one."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ValueError(f"Cannot listen on --host {host!r}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}; pick another "
                         "--port (or stop the process that holds it).") from None
    return sock
