"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, as vLLM serves it):
each request runs as a chat completion (protocol.py translates it), whose answer, whole or as
its SSE chunks, is rewritten into Anthropic's message and event shapes. Errors use Anthropic's
error body."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from minivllm.entrypoints.anthropic.protocol import (AnthropicCountTokensRequest,
                                                     AnthropicMessagesRequest, chat_messages,
                                                     error_body)
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_engine import OpenAIError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(_ERROR_TYPES.get(status, "api_error"), message),
                        status_code=status)


class AnthropicServingMessages:

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, raw_request: Request) -> Response:
        try:
            request = AnthropicMessagesRequest.model_validate(await _json_body(raw_request))
            chat_request = ChatCompletionRequest.model_validate(request.chat_request_fields())
            response = await self.chat.create_chat_completion(chat_request, raw_request)
        except OpenAIError as exc:
            return anthropic_error(int(exc.status), exc.message)
        except (ValidationError, ValueError) as exc:
            return anthropic_error(400, _validation_message(exc))
        if isinstance(response, StreamingResponse):
            events = _events(response.body_iterator, request.model or self.chat.served_model_name,
                             request.stop_sequences or [])
            return StreamingResponse(events, media_type="text/event-stream")
        if response.status_code != 200:
            return response   # 499: the client left
        return JSONResponse(message_from_chat(json.loads(response.body),
                                              request.stop_sequences or []))

    async def count_tokens(self, raw_request: Request) -> Response:
        try:
            request = AnthropicCountTokensRequest.model_validate(await _json_body(raw_request))
            self.chat.check_model(request.model)
            tools = [{"type": "function", "function": {"name": t.name, "parameters":
                                                       t.input_schema}}
                     for t in request.tools or ()] or None
            ids = self.chat.render_chat(chat_messages(request.system, request.messages),
                                        tools=tools)
        except OpenAIError as exc:
            return anthropic_error(int(exc.status), exc.message)
        except (ValidationError, ValueError) as exc:
            return anthropic_error(400, _validation_message(exc))
        return JSONResponse({"input_tokens": len(ids)})


async def _json_body(raw_request: Request) -> Any:
    try:
        return json.loads(await raw_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"The body is not JSON: {exc}") from None


def _validation_message(exc: Exception) -> str:
    if not isinstance(exc, ValidationError):
        return str(exc)
    return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'body'}: {e.get('msg', '')}"
                     for e in exc.errors())


def _stop(finish_reason: str | None, stop_reason: Any, stop_sequences: list[str],
          called: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish: "tool_use" for any
    complete call, a forced one (chat's "stop") too."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls" or called:
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:   # cut short by max_tokens: the text as it came
        return {"arguments": arguments}


def _message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def message_from_chat(chat: dict[str, Any], stop_sequences: list[str]) -> dict[str, Any]:
    """A whole chat completion (n = 1) as an Anthropic message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])})
    stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"),
                                       stop_sequences, bool(message.get("tool_calls")))
    usage = chat["usage"]
    return {"id": _message_id(chat["id"]), "type": "message", "role": "assistant",
            "model": chat["model"], "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "output_tokens": usage["completion_tokens"]}}


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


class _EventWriter:
    """Turns the chat stream's chunks into Anthropic's events: message_start, then per content
    block (thinking, text, tool_use) its start, deltas and stop, then message_delta and
    message_stop."""

    def __init__(self, model: str, stop_sequences: list[str]) -> None:
        self.model, self.stop_sequences = model, stop_sequences
        self.started = False
        self.block: str | None = None   # the open block's type
        self.index = -1
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.output_tokens = 0
        self.called = False   # a tool_use block was sent

    def chunk(self, payload: dict[str, Any]) -> list[str]:
        events = []
        usage = payload.get("usage") or {}
        self.output_tokens = usage.get("completion_tokens", self.output_tokens)
        if not self.started:
            self.started = True
            events.append(_event("message_start", {"message": {
                "id": _message_id(payload["id"]), "type": "message", "role": "assistant",
                "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": 0}}}))
        for choice in payload.get("choices") or ():
            events += self._delta(choice.get("delta") or {})
            if choice.get("finish_reason") is not None:
                self.stop = _stop(choice["finish_reason"], choice.get("stop_reason"),
                                  self.stop_sequences, self.called)
        return events

    def finish(self) -> list[str]:
        events = self._close()
        stop_reason, stop_sequence = self.stop
        events.append(_event("message_delta", {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": self.output_tokens}}))
        return events + [_event("message_stop", {})]

    def _delta(self, delta: dict[str, Any]) -> list[str]:
        events = []
        if delta.get("reasoning"):
            events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._block_delta({"type": "thinking_delta",
                                             "thinking": delta["reasoning"]}))
        if delta.get("content"):
            events += self._open("text", {"type": "text", "text": ""})
            events.append(self._block_delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id"):   # a new call: its own block
                self.called = True
                events += self._close()
                events += self._open("tool_use", {"type": "tool_use", "id": call["id"],
                                                  "name": function.get("name") or "",
                                                  "input": {}})
            if function.get("arguments"):
                events.append(self._block_delta({"type": "input_json_delta",
                                                 "partial_json": function["arguments"]}))
        return events

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        if self.block == kind and kind != "tool_use":
            return []
        events = self._close()
        self.block, self.index = kind, self.index + 1
        return events + [_event("content_block_start", {"index": self.index,
                                                        "content_block": block})]

    def _block_delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> list[str]:
        if self.block is None:
            return []
        self.block = None
        return [_event("content_block_stop", {"index": self.index})]


async def _events(chunks: AsyncIterator[str], model: str, stop_sequences: list[str]
                  ) -> AsyncIterator[str]:
    writer = _EventWriter(model, stop_sequences)
    async for sse in chunks:
        for line in sse.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: "):])
            if "error" in payload:   # the chat stream's in-band error
                error = payload["error"]
                yield _event("error", {"error": {"type": _ERROR_TYPES.get(
                    error.get("code"), "api_error"), "message": error.get("message", "")}})
                return
            for event in writer.chunk(payload):
                yield event
    for event in writer.finish():
        yield event
