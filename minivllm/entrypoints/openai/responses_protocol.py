"""Bodies of the OpenAI Responses API (/v1/responses): the request, its input items as chat
messages, and the response object with its output items, in OpenAI's shapes.

A Responses request is served as a chat completion: `ResponsesRequest.chat_request_fields` gives
the `ChatCompletionRequest` fields (tools and text.format translated), so the chat template,
sampling, tool parsing and structured outputs have one home (serving_chat.py).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from minivllm.entrypoints.openai.protocol import OpenAIBaseModel, random_uuid

# `include` values: logprobs of the output text are returned; this server makes no reasoning
# items, so asking for their encrypted content is allowed and includes nothing.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
_INCLUDABLE = (INCLUDE_LOGPROBS, "reasoning.encrypted_content")
_INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PART_TYPES = ("input_text", "output_text", "text", "refusal", "reasoning_text")


class ResponsesTextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel attribute; the JSON key stays "schema".
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesTextConfig(OpenAIBaseModel):
    format: ResponsesTextFormat = Field(default_factory=ResponsesTextFormat)


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    include: list[str] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    # "none", "auto", "required" or {"type": "function", "name": ...}
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: ResponsesTextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    # vLLM's extras (sent with the openai client through `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None   # vLLM's StructuredOutputsParams fields
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = Field(default=0, ge=-2**63, le=2**63 - 1)
    cache_salt: str | None = None   # checked as the chat request's (protocol.py)

    def check_supported(self) -> None:
        """ValueError, starting with the field's name, for what this server does not serve."""
        for name in self.include or ():
            if name not in _INCLUDABLE:
                raise ValueError(f"include {name!r} is not supported; choose from "
                                 f"{', '.join(_INCLUDABLE)}.")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise ValueError("reasoning options (effort, summary) are not supported: these "
                             "models take no effort setting (a server started with "
                             "--reasoning-parser returns their reasoning as reasoning items; "
                             "chat_template_kwargs turn a template's thinking on or off).")
        for i, tool in enumerate(self.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise ValueError(f"tools[{i}] has type {kind!r}; only function tools "
                                 '({"type": "function", "name": ..., "parameters": {...}}) run '
                                 "here: built-in tools (web search, file search, ...) do not.")

    @property
    def include_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or ())

    def chat_request_fields(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The ChatCompletionRequest that serves this request, as a dict of its fields."""
        fields: dict[str, Any] = {
            "model": self.model, "messages": messages, "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "user": self.user, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed,
            "presence_penalty": self.presence_penalty, "stop": self.stop,
            "frequency_penalty": self.frequency_penalty,
            "skip_special_tokens": self.skip_special_tokens, "ignore_eos": self.ignore_eos,
            "structured_outputs": self.structured_outputs, "priority": self.priority,
            "cache_salt": self.cache_salt,
            "chat_template_kwargs": self.chat_template_kwargs,
            "parallel_tool_calls": self.parallel_tool_calls,
            "logprobs": self.include_logprobs,
            "top_logprobs": self.top_logprobs if self.include_logprobs else None}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                k: v for k, v in tool.items() if k != "type"}} for tool in self.tools]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        if self.tools or choice != "auto":
            fields["tool_choice"] = choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "description": fmt.description,
                "schema": fmt.json_schema, "strict": fmt.strict}}
        elif fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        return fields


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as chat messages: a string is one user message; items are messages
    (role + text or text parts), function calls (merged into one assistant message per run),
    their outputs (tool messages) and reasoning (the next assistant message's
    `reasoning_content`, as templates read it). ValueError naming the first bad item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning.append(_text_parts(f"input[{i}].content", item.get("content") or []))
            continue
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            call = {"id": _string(i, item, "call_id"), "type": "function", "function": {
                "name": _string(i, item, "name"), "arguments": _string(i, item, "arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(i, item, "call_id"),
                             "content": output if isinstance(output, str)
                             else _text_parts(f"input[{i}].output", output)})
        else:
            raise ValueError(f"input[{i}] has type {kind!r}; valid input item types are "
                             f"{', '.join(_INPUT_ITEM_TYPES)}.")
        if reasoning:   # belongs to the assistant turn right after it (else dropped)
            if messages[-1]["role"] == "assistant":
                messages[-1]["reasoning_content"] = "".join(reasoning)
            reasoning = []
    return messages


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise ValueError(f"input[{i}].role must be one of {', '.join(_MESSAGE_ROLES)}, got "
                         f"{role!r}.")
    content = item.get("content")
    text = content if isinstance(content, str) else _text_parts(f"input[{i}].content", content)
    # Chat templates know "system"; OpenAI's "developer" messages play that part.
    return {"role": "system" if role == "developer" else role, "content": text}


def _text_parts(where: str, parts: Any) -> str:
    if not isinstance(parts, list):
        raise ValueError(f"{where} must be a string or a list of text parts.")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PART_TYPES:
            raise ValueError(f"{where}[{j}] has type {kind!r}; this server serves text models: "
                             f"valid part types are {', '.join(_TEXT_PART_TYPES)}.")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise ValueError(f"{where}[{j}] needs its text as a string.")
        texts.append(text)
    return "".join(texts)


def _string(i: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"input[{i}].{key} must be a string ({item.get('type')} items need "
                         "call_id, and function calls name and arguments).")
    return value


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue its conversation."""
    return input_messages([{**item, "role": "assistant"} if item["type"] == "message" else item
                           for item in output])


# ---------------------------------------------------------------- the response object

def message_item(text: str, status: str, logprobs: list[dict[str, Any]] | None = None,
                 item_id: str | None = None) -> dict[str, Any]:
    """An assistant message output item with one output_text part."""
    return {"type": "message", "id": item_id or f"msg_{random_uuid()}", "role": "assistant",
            "status": status, "content": [output_text_part(text, logprobs)]}


def output_text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def function_call_item(name: str, arguments: str, status: str,
                       call_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{random_uuid()}",
            "call_id": call_id or f"call_{random_uuid()}", "name": name, "arguments": arguments,
            "status": status}


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, cached_tokens: int, output_tokens: int) -> ResponseUsage:
        return cls(input_tokens=input_tokens, input_tokens_details={"cached_tokens": cached_tokens},
                   output_tokens=output_tokens, output_tokens_details={"reasoning_tokens": 0},
                   total_tokens=input_tokens + output_tokens)


class ResponsesResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"resp_{random_uuid()}")
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    # queued / in_progress (background), completed, incomplete, cancelled, failed
    status: str
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, str] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    store: bool = False
    background: bool = False
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    user: str | None = None

    @classmethod
    def for_request(cls, request: ResponsesRequest, model: str, status: str,
                    **fields: Any) -> ResponsesResponse:
        """A response that echoes the request's settings, as OpenAI's does."""
        text = request.text.model_dump(mode="json", by_alias=True, exclude_none=True) \
            if request.text is not None else {"format": {"type": "text"}}
        return cls(status=status, model=model, instructions=request.instructions,
                   max_output_tokens=request.max_output_tokens, metadata=request.metadata,
                   parallel_tool_calls=request.parallel_tool_calls,
                   previous_response_id=request.previous_response_id,
                   temperature=request.temperature, top_p=request.top_p,
                   top_logprobs=request.top_logprobs, tool_choice=request.tool_choice,
                   tools=request.tools, text=text, truncation=request.truncation,
                   store=request.store, background=request.background,
                   reasoning=request.reasoning, service_tier=request.service_tier,
                   user=request.user, **fields)
