"""OpenAI's Responses API: POST /v1/responses (JSON or its typed SSE events), and for stored
responses GET / DELETE /v1/responses/{id} and POST /v1/responses/{id}/cancel.

A response is served as a chat completion of its conversation: the stored conversation of
`previous_response_id`, then `input` (`instructions` as the system message, not carried over).
Storing follows vLLM: off unless VLLM_ENABLE_RESPONSES_API_STORE=1 (then `store` defaults to
true); without it a response says `store: false`, and what needs a stored one (retrieval,
previous_response_id, background) gets an error naming the variable.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from minivllm.engine.async_llm import RequestStream
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, random_uuid
from minivllm.entrypoints.openai.responses_output import Event, ResponseOutputBuilder
from minivllm.entrypoints.openai.responses_protocol import (ResponsesRequest, ResponsesResponse,
                                                            ResponseUsage, input_messages,
                                                            output_messages)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_engine import OpenAIError, engine_error, merge_streams
from minivllm.outputs import RequestOutput

# Stored responses are kept in memory, the least recently used dropped past this many.
MAX_STORED_RESPONSES = 4096
_STORE_HINT = "set VLLM_ENABLE_RESPONSES_API_STORE=1 when starting the server to keep responses"
# chat request field -> the Responses API field it came from
_ALIASES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
            "response_format": "text", "messages": "input", "prompt": "input"}


@dataclass
class _Stored:
    response: ResponsesResponse
    # chat messages through this response's output (without instructions); None until done
    conversation: list[dict[str, Any]] | None = None
    task: asyncio.Task | None = None   # a background response's run


class ResponseStore:
    """Stored responses by id, in memory, least recently used first out past `capacity`."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, _Stored] = OrderedDict()

    def put(self, entry: _Stored) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> _Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> _Stored | None:
        return self._entries.pop(response_id, None)


@dataclass
class _Job:
    """One response being made: its request, the chat request that serves it, its output."""
    request: ResponsesRequest
    chat_request: ChatCompletionRequest
    model: str
    prompt_ids: list[int]
    conversation: list[dict[str, Any]]
    builder: ResponseOutputBuilder
    id: str = field(default_factory=lambda: f"resp_{random_uuid()}")
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def response(self, status: str, **fields: Any) -> ResponsesResponse:
        return ResponsesResponse.for_request(self.request, self.model, status, id=self.id,
                                             created_at=self.created_at, **fields)


class OpenAIServingResponses(OpenAIServingChat):

    def __init__(self, *args, enable_store: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.enable_store = enable_store
        self.store = ResponseStore()

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        lora_request = self.check_model(request.model)
        self._check_request(request)
        try:
            job = self._job(request)
            max_tokens = self.resolve_max_tokens(job.num_prompt_tokens,
                                                 job.chat_request.requested_max_tokens,
                                                 "max_output_tokens")
            params = self.sampling_params(job.chat_request, max_tokens, _ALIASES)
        except OpenAIError as exc:   # named by the chat request's fields: use this API's names
            exc.param = _ALIASES.get(exc.param, exc.param)
            raise
        [stream] = self.add_requests([(job.id, job.prompt_ids, params)], lora_request,
                                     request.priority, request.cache_salt)
        if request.background:
            entry = _Stored(job.response("queued"))
            self.store.put(entry)
            entry.task = asyncio.create_task(self._run_background(job, stream, entry))
            return JSONResponse(entry.response.model_dump(mode="json"))
        if request.stream:
            return StreamingResponse(self._stream(job, stream), media_type="text/event-stream")
        final = await self.final_output(raw_request, stream)
        if final is None:
            return Response(status_code=499)   # the client is gone; nobody reads this
        job.builder.update(final.outputs[0])
        response, _ = self._complete(job, final)
        return JSONResponse(response.model_dump(mode="json"))

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self._lookup(response_id).response.model_dump(mode="json")

    async def cancel(self, response_id: str) -> dict[str, Any]:
        entry = self._lookup(response_id)
        if not entry.response.background:
            raise OpenAIError("Only responses created with background=true can be cancelled.",
                              param="response_id")
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await asyncio.wait({entry.task})
        return entry.response.model_dump(mode="json")

    async def delete(self, response_id: str) -> dict[str, Any]:
        entry = self._lookup(response_id)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await asyncio.wait({entry.task})
        self.store.pop(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _check_request(self, request: ResponsesRequest) -> None:
        try:
            request.check_supported()
        except ValueError as exc:
            raise OpenAIError(str(exc), param=str(exc).split(" ", 1)[0].split("[")[0]) from exc
        if not self.enable_store:
            if request.background:
                raise OpenAIError(f"background needs a stored response: {_STORE_HINT}.",
                                  param="background")
            request.store = False   # vLLM's behaviour: the response says it was not stored
        if request.background and not request.store:
            raise OpenAIError("background needs store=true.", param="background")
        if request.background and request.stream:
            raise OpenAIError("background responses are not streamed here: create it, then "
                              "poll GET /v1/responses/{id}.", param="stream")

    def _lookup(self, response_id: str, param: str = "response_id") -> _Stored:
        entry = self.store.get(response_id) if self.enable_store else None
        if entry is None:
            hint = "" if self.enable_store else f" (this server stores no responses: {_STORE_HINT})"
            raise OpenAIError(f"Response with id '{response_id}' not found{hint}.",
                              HTTPStatus.NOT_FOUND, param)
        return entry

    def _job(self, request: ResponsesRequest) -> _Job:
        """The conversation rendered to prompt ids through the chat template (its oldest
        messages dropped while it does not fit, with truncation="auto")."""
        conversation = []
        if request.previous_response_id is not None:
            previous = self._lookup(request.previous_response_id, "previous_response_id")
            if previous.conversation is None:
                raise OpenAIError(f"Response '{request.previous_response_id}' is "
                                  f"{previous.response.status}; only a finished response can be "
                                  "continued.", param="previous_response_id")
            conversation = list(previous.conversation)
        try:
            conversation += input_messages(request.input)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="input") from exc
        system = [{"role": "system", "content": request.instructions}] if request.instructions \
            else []
        kept = conversation
        while True:
            chat_request = _chat_request(request, system + kept)
            mode = self.tool_mode(chat_request)
            prompt_ids = self.render_chat(chat_request.messages, tools=chat_request.tools,
                                          chat_template_kwargs=chat_request.chat_template_kwargs)
            if request.truncation != "auto" or self._fits(len(prompt_ids), request) \
                    or len(kept) <= 1:
                break
            kept = _drop_oldest_turn(kept)
        self.check_token_ids(prompt_ids, param="input")
        builder = ResponseOutputBuilder(self, chat_request, mode,
                                        self.starts_in_reasoning(prompt_ids))
        return _Job(request, chat_request, self.model_name(request.model), prompt_ids,
                    conversation, builder)

    def _fits(self, num_prompt_tokens: int, request: ResponsesRequest) -> bool:
        return num_prompt_tokens + (request.max_output_tokens or 1) <= self.max_model_len

    def _complete(self, job: _Job, final: RequestOutput) -> tuple[ResponsesResponse, list[Event]]:
        """The finished response, stored when asked to be, and the events that close its
        items."""
        out = final.outputs[0]
        incomplete = out.finish_reason == "length"
        events = job.builder.finish(incomplete)
        usage = ResponseUsage.of(job.num_prompt_tokens, final.num_cached_tokens,
                                 len(out.token_ids))
        response = job.response("incomplete" if incomplete else "completed",
                                output=job.builder.items, usage=usage,
                                incomplete_details={"reason": "max_output_tokens"}
                                if incomplete else None)
        if job.request.store:
            self.store.put(_Stored(response, job.conversation + output_messages(response.output)))
        return response, events

    async def _stream(self, job: _Job, stream: RequestStream) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events.send({"type": "response.created",
                           "response": job.response("in_progress").model_dump(mode="json")})
        yield events.send({"type": "response.in_progress",
                           "response": job.response("in_progress").model_dump(mode="json")})
        try:
            final = None
            async with aclosing(merge_streams([stream])) as merged:
                async for _, final in merged:
                    for event in job.builder.update(final.outputs[0]):
                        yield events.send(event)
            if final is None:
                raise RuntimeError("the request ended without output")
            response, closing = self._complete(job, final)
            for event in closing:
                yield events.send(event)
            yield events.send({"type": f"response.{response.status}",
                               "response": response.model_dump(mode="json")})
        except Exception as exc:   # noqa: BLE001 - the status line is sent; report in-band
            yield events.send({"type": "response.failed",
                               "response": _failed(job, exc).model_dump(mode="json")})

    async def _run_background(self, job: _Job, stream: RequestStream, entry: _Stored) -> None:
        entry.response.status = "in_progress"
        try:
            final = await self._collect(stream)
            job.builder.update(final.outputs[0])
            self._complete(job, final)   # stores the finished response in place of `entry`
        except asyncio.CancelledError:
            entry.response.status = "cancelled"   # its request was aborted (merge_streams)
        except Exception as exc:   # noqa: BLE001 - reported through the stored response
            entry.response = _failed(job, exc)


class _EventWriter:
    """SSE events of a response stream: `event: <type>` and the JSON with its sequence number."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def send(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event['type']}\ndata: {data}\n\n"


def _failed(job: _Job, exc: BaseException) -> ResponsesResponse:
    error = engine_error(exc)
    code = {HTTPStatus.BAD_REQUEST: "invalid_prompt",
            HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_exceeded"}.get(error.status, "server_error")
    return job.response("failed", error={"code": code, "message": error.message})


def _chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(request.chat_request_fields(messages))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        param = _ALIASES.get(str(first.get("loc", ("",))[0]), where.split(".")[0] or None)
        raise OpenAIError(f"{where}: {first.get('msg', '')}", param=param) from exc


def _drop_oldest_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation without its first message, nor tool results left without their call."""
    rest = messages[1:]
    while len(rest) > 1 and rest[0]["role"] == "tool":
        rest = rest[1:]
    return rest
