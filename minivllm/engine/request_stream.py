"""What a server handler holds for one request: the stream of its cumulative outputs
(`RequestStream`), fed by the AsyncLLM loop thread through `_Stream`."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from minivllm.outputs import RequestOutput
from minivllm.sampling_params import RequestOutputKind


# Ends a stream that has no final output to give (a request aborted before the engine held it).
STREAM_FINISHED = object()


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
                if item is STREAM_FINISHED:
                    self.finished = True
                    return
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self._abort(self.request_id)


async def outputs_of_kind(outputs: AsyncIterator[RequestOutput],
                          kind: RequestOutputKind) -> AsyncIterator[RequestOutput]:
    """vLLM's `output_kind` over cumulative outputs: as they are, only the final one, or each
    completion's text, tokens and logprobs new since the previous output (DELTA; the
    cumulative logprob stays the running total, as in vLLM)."""
    if kind == RequestOutputKind.CUMULATIVE:
        async for output in outputs:
            yield output
        return
    if kind == RequestOutputKind.FINAL_ONLY:
        async for output in outputs:
            if output.finished:
                yield output
        return
    seen: dict[int, tuple[int, int, int]] = {}     # index -> (chars, tokens, logprobs) sent
    async for output in outputs:
        deltas = []
        for out in output.outputs:
            chars, tokens, lps = seen.get(out.index, (0, 0, 0))
            deltas.append(dataclasses.replace(
                out, text=out.text[chars:], token_ids=out.token_ids[tokens:],
                logprobs=None if out.logprobs is None else out.logprobs[lps:]))
            seen[out.index] = (len(out.text), len(out.token_ids),
                               0 if out.logprobs is None else len(out.logprobs))
        yield dataclasses.replace(output, outputs=deltas)
