"""A completion's growing text as the Responses API's output items and the stream events that
build them (response.output_item.added, response.output_text.delta, ...).

Streamed and non-streamed responses both run `ResponseOutputBuilder` (the latter once, on the
final output), so their items are the same; the text and tool-call split is the chat server's
(`OpenAIServingChat.stream_delta`), so tool parsing has one home.
"""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.openai.chat_protocol import DeltaToolCall
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, random_uuid
from minivllm.entrypoints.openai.responses_protocol import (function_call_item, message_item,
                                                            output_text_part)
from minivllm.entrypoints.openai.serving_chat import ChoiceState, OpenAIServingChat
from minivllm.outputs import CompletionOutput

Event = dict[str, Any]


class ResponseOutputBuilder:
    """The output items of one response. `update` takes the request's latest CompletionOutput
    (cumulative) and returns the events for what is new; `finish` closes the open items."""

    def __init__(self, chat: OpenAIServingChat, chat_request: ChatCompletionRequest,
                 mode: str | None, in_reasoning: bool = False) -> None:
        self.chat, self.chat_request, self.mode = chat, chat_request, mode
        self.items: list[dict[str, Any]] = []
        self._state = ChoiceState(in_reasoning)
        self._reasoning: dict[str, Any] | None = None    # the open reasoning item
        self._message: dict[str, Any] | None = None      # the open message item
        self._logprobs: list[dict[str, Any]] = []       # its text's logprobs so far
        self._pending: list[dict[str, Any]] = []        # logprobs of text not yet sent
        self._calls: dict[int, dict[str, Any]] = {}     # tool-call index -> open item

    def update(self, out: CompletionOutput) -> list[Event]:
        finished = out.finish_reason is not None
        reasoning, delta, calls = self.chat.stream_delta(self.chat_request, self.mode, out.text,
                                                         finished, self._state)
        logprobs = self.chat.chat_logprobs(self.chat_request, out, self._state.num_tokens)
        self._state.num_tokens = len(out.token_ids)
        if logprobs is not None:
            self._pending.extend(c.model_dump(mode="json") for c in logprobs.content or ())
        events: list[Event] = self._reasoning_delta(reasoning) if reasoning else []
        if delta:
            events += self._close_reasoning()
            events += self._open_message()
            sent, self._pending = self._pending, []
            self._logprobs.extend(sent)
            self._message["content"][0]["text"] += delta
            events.append({"type": "response.output_text.delta", **self._where(self._message),
                           "content_index": 0, "delta": delta, "logprobs": sent})
        for call in calls:
            events += self._call_delta(call)
        return events

    def finish(self, incomplete: bool) -> list[Event]:
        """Closes the open items (status "incomplete" when the response was cut short); a
        response with no output gets one empty message, as OpenAI's has."""
        events: list[Event] = self._close_reasoning(incomplete)
        if not any(item["type"] != "reasoning" for item in self.items):
            events += self._open_message()
        events += self._close_message(incomplete)
        for index in sorted(self._calls):
            item = self._calls[index]
            item["status"] = "incomplete" if incomplete else "completed"
            events.append({"type": "response.function_call_arguments.done", **self._where(item),
                           "name": item["name"], "arguments": item["arguments"]})
            events.append(self._item_event("response.output_item.done", item))
        self._calls.clear()
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _item_event(self, kind: str, item: dict[str, Any]) -> Event:
        return {"type": kind, "output_index": self.items.index(item), "item": _copy(item)}

    def _reasoning_delta(self, delta: str) -> list[Event]:
        """Reasoning text: a reasoning item (opened on its first text) with one reasoning_text
        part."""
        events: list[Event] = []
        if self._reasoning is None:
            self._reasoning = {"type": "reasoning", "id": f"rs_{random_uuid()}", "summary": [],
                               "content": [], "status": "in_progress"}
            self.items.append(self._reasoning)
            events.append(self._item_event("response.output_item.added", self._reasoning))
            self._reasoning["content"].append({"type": "reasoning_text", "text": ""})
        self._reasoning["content"][0]["text"] += delta
        events.append({"type": "response.reasoning_text.delta", **self._where(self._reasoning),
                       "content_index": 0, "delta": delta})
        return events

    def _close_reasoning(self, incomplete: bool = False) -> list[Event]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        item["status"] = "incomplete" if incomplete else "completed"
        return [{"type": "response.reasoning_text.done", **self._where(item), "content_index": 0,
                 "text": item["content"][0]["text"]},
                self._item_event("response.output_item.done", item)]

    def _open_message(self) -> list[Event]:
        if self._message is not None:
            return []
        self._message = message_item("", "in_progress",
                                     [] if self.chat_request.logprobs else None)
        self._message["content"] = []
        self.items.append(self._message)
        part = output_text_part("", [] if self.chat_request.logprobs else None)
        added = self._item_event("response.output_item.added", self._message)
        self._message["content"].append(part)
        return [added, {"type": "response.content_part.added", **self._where(self._message),
                        "content_index": 0, "part": dict(part)}]

    def _close_message(self, incomplete: bool) -> list[Event]:
        item, self._message = self._message, None
        if item is None:
            return []
        part = item["content"][0]
        if "logprobs" in part:
            part["logprobs"] = self._logprobs + self._pending
        self._logprobs, self._pending = [], []
        item["status"] = "incomplete" if incomplete else "completed"
        where = self._where(item)
        done = {"type": "response.output_text.done", **where, "content_index": 0,
                "text": part["text"]}
        if "logprobs" in part:
            done["logprobs"] = part["logprobs"]
        return [done, {"type": "response.content_part.done", **where, "content_index": 0,
                       "part": _copy(part)},
                self._item_event("response.output_item.done", item)]

    def _call_delta(self, call: DeltaToolCall) -> list[Event]:
        events: list[Event] = []
        item = self._calls.get(call.index)
        if item is None:
            events += self._close_reasoning()
            events += self._close_message(False)   # text before a call is a message of its own
            item = function_call_item(call.function.name or "", "", "in_progress", call.id)
            self._calls[call.index] = item
            self.items.append(item)
            events.append(self._item_event("response.output_item.added", item))
        fragment = call.function.arguments or ""
        if fragment:
            item["arguments"] += fragment
            events.append({"type": "response.function_call_arguments.delta", **self._where(item),
                           "delta": fragment})
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot for an event (the item keeps growing after it is sent)."""
    return {k: ([dict(p) for p in v] if k == "content" else v) for k, v in item.items()}
