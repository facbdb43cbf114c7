"""What a server handler holds for one request: the stream of its cumulative outputs
(`RequestStream`), fed by the AsyncLLM loop thread through `_Stream`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from minivllm.outputs import RequestOutput


@dataclass
class _Stream:
    """The loop-side state of one request: where its outputs go, and its timings."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_seqs: int
    arrival_s: float                # time.monotonic() at submission
    admitted: bool = False          # handed to the engine
    num_tokens: int = 0
    last_token_s: float | None = None


@dataclass
class RequestStream:
    """What a handler iterates: the cumulative `RequestOutput`s of one request."""

    request_id: str
    _stream: _Stream
    _abort: Callable[[str], None]
    finished: bool = field(default=False, init=False)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yields outputs until the request finishes; leaving early aborts the request.

        Outputs are cumulative, so when the consumer lags, only the newest one is yielded.
        """
        try:
            while not self.finished:
                items = [await self._stream.queue.get()]
                while not self._stream.queue.empty():
                    items.append(self._stream.queue.get_nowait())
                item = items[-1]
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self._abort(self.request_id)
