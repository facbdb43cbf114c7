"""post_sse against a raw asyncio server: events split across and packed into chunks, and a
non-200 answer."""

import asyncio
import json

import pytest

from minivllm.benchmarks.sse_client import HTTPStatusError, post_sse

_EVENTS = b'data: {"a": 1}\n\ndata: {"b": 2}\n\n: a comment\n\ndata: [DONE]\n\n'


async def _serve(status: int, seen: list) -> tuple[asyncio.AbstractServer, int]:
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        seen.append((head.split(b" ")[1], json.loads(await reader.readexactly(length))))
        if status != 200:
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\nbad request")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for piece in (_EVENTS[:5], _EVENTS[5:30], _EVENTS[30:]):   # cuts inside events
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_events_across_chunks_and_errors():
    async def run():
        seen: list = []
        server, port = await _serve(200, seen)
        async with server:
            events = [e async for e in post_sse(f"http://127.0.0.1:{port}", "/v1/x", {"q": 1})]
        bad, port = await _serve(400, seen)
        async with bad:
            with pytest.raises(HTTPStatusError, match="HTTP 400"):
                [e async for e in post_sse(f"http://127.0.0.1:{port}/", "/v1/x", {})]
        return events, seen

    events, seen = asyncio.run(run())
    assert events == ['{"a": 1}', '{"b": 2}', "[DONE]"]
    assert seen[0] == (b"/v1/x", {"q": 1}) and seen[1][0] == b"/v1/x"
    with pytest.raises(ValueError, match="plain http"):
        asyncio.run(anext(post_sse("https://example.invalid", "/", {})))
