"""POST /v1/chat/completions: messages through the chat template, n choices, JSON or SSE."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.engine.async_llm import RequestStream
from minivllm.entrypoints.openai.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                  ChatCompletionLogProbsContent,
                                                  ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatCompletionResponseChoice,
                                                  ChatCompletionStreamChoice,
                                                  ChatCompletionStreamResponse, ChatMessage,
                                                  DeltaMessage, UsageInfo, random_uuid)
from minivllm.entrypoints.openai.serving_engine import (OpenAIServing, clamp_logprob, engine_error,
                                                        merge_streams, run_until_disconnect, sse,
                                                        sse_error)
from minivllm.outputs import CompletionOutput, Logprob


@dataclass
class _ChoiceState:
    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False


class OpenAIServingChat(OpenAIServing):

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        self.check_model(request.model)
        prompt_ids = self.render_chat(request.messages, request.add_generation_prompt,
                                      request.chat_template)
        self.check_token_ids(prompt_ids, param="messages")
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(prompt_ids), request.requested_max_tokens, param)
        params = self.sampling_params(request, max_tokens, {"max_tokens": param})
        request_id = f"chatcmpl-{random_uuid()}"
        [stream] = self.add_requests([(request_id, prompt_ids, params)])
        created = int(time.time())
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, created, len(prompt_ids), stream),
                                     media_type="text/event-stream")
        try:
            final = await run_until_disconnect(raw_request, self._collect(stream))
        except Exception as exc:
            raise engine_error(exc) from exc
        if final is None:
            return Response(status_code=499)   # the client is gone; nobody reads this
        choices = [ChatCompletionResponseChoice(
            index=out.index, message=ChatMessage(role="assistant", content=out.text),
            logprobs=self._logprobs(request, out, 0), finish_reason=out.finish_reason,
            stop_reason=out.stop_reason) for out in final.outputs]
        num_completion = sum(len(out.token_ids) for out in final.outputs)
        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=num_completion,
                          total_tokens=len(prompt_ids) + num_completion)
        response = ChatCompletionResponse(id=request_id, created=created,
                                          model=self.served_model_name, choices=choices, usage=usage)
        return JSONResponse(response.model_dump(mode="json"))

    @staticmethod
    async def _collect(stream: RequestStream):
        final = None
        async with aclosing(merge_streams([stream])) as merged:
            async for _, output in merged:
                final = output
        return final

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int,
                      num_prompt_tokens: int, stream: RequestStream) -> AsyncIterator[str]:
        states = [_ChoiceState() for _ in range(request.n)]

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionStreamResponse(id=request_id, created=created, choices=choices,
                                                model=self.served_model_name, usage=usage)
            payload = body.model_dump(mode="json")
            for choice in payload["choices"]:   # OpenAI's deltas carry only the fields they set
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return sse(json.dumps(payload, ensure_ascii=False))

        final = None
        try:
            # The role comes first, in a chunk of its own per choice (as OpenAI does).
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                         for i in range(request.n)])
            async with aclosing(merge_streams([stream])) as merged:
                async for _, final in merged:
                    choices = [c for out in final.outputs
                               if (c := self._stream_choice(request, out, states[out.index]))]
                    if choices:
                        yield chunk(choices)
            if request.include_usage and final is not None:
                num_completion = sum(len(out.token_ids) for out in final.outputs)
                yield chunk([], UsageInfo(prompt_tokens=num_prompt_tokens,
                                          completion_tokens=num_completion,
                                          total_tokens=num_prompt_tokens + num_completion))
        except Exception as exc:   # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(exc)
        yield "data: [DONE]\n\n"

    def _stream_choice(self, request: ChatCompletionRequest, out: CompletionOutput,
                       state: _ChoiceState) -> ChatCompletionStreamChoice | None:
        if state.finished:
            return None
        delta = out.text[state.num_chars:]
        state.num_chars = max(state.num_chars, len(out.text))
        logprobs = self._logprobs(request, out, state.num_tokens)
        state.num_tokens = len(out.token_ids)
        state.finished = out.finish_reason is not None
        if logprobs is not None and not logprobs.content:
            logprobs = None
        if not delta and logprobs is None and not state.finished:
            return None
        return ChatCompletionStreamChoice(
            index=out.index, delta=DeltaMessage(content=delta or None), logprobs=logprobs,
            finish_reason=out.finish_reason, stop_reason=out.stop_reason)

    def _logprobs(self, request: ChatCompletionRequest, out: CompletionOutput,
                  start: int) -> ChatCompletionLogProbs | None:
        """Chat schema: per token, its logprob and bytes, then the top_logprobs by rank."""
        if not request.logprobs:
            return None
        num_top = request.top_logprobs or 0
        content = []
        for token_id, step in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
            entry = step.get(token_id)
            if entry is None:
                continue
            top = sorted(((tid, lp) for tid, lp in step.items()
                          if lp.rank is not None and lp.rank <= num_top), key=lambda x: x[1].rank)
            content.append(ChatCompletionLogProbsContent(
                **self._logprob(token_id, entry).model_dump(),
                top_logprobs=[self._logprob(tid, lp) for tid, lp in top][:num_top]))
        return ChatCompletionLogProbs(content=content)

    def _logprob(self, token_id: int, lp: Logprob) -> ChatCompletionLogProb:
        token = lp.decoded_token
        if token is None:
            token = f"token_id:{token_id}"
        return ChatCompletionLogProb(token=token, logprob=clamp_logprob(lp.logprob),
                                     bytes=list(token.encode("utf-8", errors="replace")))
