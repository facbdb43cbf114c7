"""The streaming client of `bench serve`: one HTTP/1.1 POST per request on asyncio streams, its
server-sent events yielded as they arrive.

Why not httpx here: on the benchmark's own host its client stack (httpcore, h11, anyio) cost
~0.17 ms of CPU per streamed token, a tenth of what the server spent, taken from the same cores
(vLLM's `bench serve` uses aiohttp for the same reason). This reads the chunked body with
StreamReader's C-level readline/readexactly and splits events on blank lines.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    """A response other than 200; the message holds the status and the start of the body."""


async def post_sse(base_url: str, path: str, body: dict[str, Any]) -> AsyncIterator[str]:
    """POSTs `body` as JSON and yields the `data:` payload of each event (`[DONE]` included)."""
    url = urlsplit(base_url)
    if url.scheme != "http":
        raise ValueError(f"bench serve streams over plain http only, got {base_url!r}.")
    host, port = url.hostname or "127.0.0.1", url.port or 80
    payload = json.dumps(body).encode()
    head = (f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head.encode() + payload)
        status, headers = await _read_head(reader)
        if status != 200:
            raise HTTPStatusError(f"HTTP {status}: {(await reader.read(200))!r}")
        if "chunked" not in headers.get("transfer-encoding", ""):
            raise HTTPStatusError("the event stream is not chunked")
        buffer = b""
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            if size == 0:
                return
            buffer += (await reader.readexactly(size + 2))[:-2]   # the chunk and its CRLF
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:].decode()
    finally:
        writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status = int((await reader.readline()).split(b" ", 2)[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    return status, headers
