"""The server's beam search (vLLM's `use_beam_search`): `BeamSearchStream` drives one prompt's
`minivllm.beam_search.BeamSearch` on the `AsyncLLM`, each step's beams as concurrent one-token
requests, and yields one final `RequestOutput` whose completions are the best beams (as a
`RequestStream` yields, so the serving code treats both alike). Leaving early, or a client that
goes away, aborts the step's requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from minivllm.beam_search import BeamSearch, BeamSearchSequence
from minivllm.engine.async_llm import AsyncLLM, RequestStream
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import BeamSearchParams


class BeamSearchStream:
    """One prompt's search; `outputs()` yields its result once, finished."""

    def __init__(self, async_llm: AsyncLLM, request_id: str, prompt_token_ids: list[int],
                 params: BeamSearchParams, lora_request: Any,
                 decode: Callable[[list[int]], str]) -> None:
        self.async_llm, self.request_id, self.params = async_llm, request_id, params
        self.prompt_token_ids, self.lora_request = prompt_token_ids, lora_request
        self.decode = decode
        self.finished = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        search = BeamSearch([self.prompt_token_ids], self.params, self.async_llm.eos_token_id,
                            [self.lora_request])
        step = 0
        while beams := search.next_beams():
            streams = self._add(beams, search, step)
            search.advance(await asyncio.gather(*(_final(s) for s in streams)))
            step += 1
        [result] = search.results()   # text: the generated part, in _completion
        self.finished = True
        yield RequestOutput(
            request_id=self.request_id, prompt=None, prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None, finished=True,
            outputs=[self._completion(i, beam) for i, beam in enumerate(result.sequences)])

    def _add(self, beams: list[BeamSearchSequence], search: BeamSearch,
             step: int) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, beam in enumerate(beams):
                streams.append(self.async_llm.add_request(
                    f"{self.request_id}-beam{step}-{i}", beam.tokens, search.step_params,
                    beam.lora_request))
        except BaseException:
            for stream in streams:
                self.async_llm.abort(stream.request_id)
            raise
        return streams

    def _completion(self, index: int, beam: BeamSearchSequence) -> CompletionOutput:
        """vLLM's server answer: the generated tokens (a final eos kept in token_ids, left out
        of the text)."""
        generated = beam.tokens[len(self.prompt_token_ids):]
        shown = generated[:-1] if beam.finish_reason == "stop" else generated
        return CompletionOutput(index=index, text=self.decode(shown), token_ids=generated,
                                cumulative_logprob=beam.cum_logprob, logprobs=None,
                                finish_reason=beam.finish_reason)


async def _final(stream: RequestStream) -> RequestOutput:
    """The stream's last output (aclosing: a cancelled step aborts its request at once)."""
    last = None
    async with aclosing(stream.outputs()) as outputs:
        async for output in outputs:
            last = output
    assert last is not None and last.finished, "a request stream ended unfinished"
    return last
