"""Bodies of Anthropic's Messages API (POST /v1/messages), as vLLM's `vllm.entrypoints.anthropic`
serves them, and their translation to the chat-completions request that runs them: one home for
the chat template, sampling, tool parsing and stop handling (serving_chat.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_BLOCK_TYPES = ("text", "tool_use", "tool_result")


class AnthropicBaseModel(BaseModel):
    # Unknown fields (cache_control, citations, ...) are ignored, as the OpenAI models do.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class AnthropicMessage(AnthropicBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(AnthropicBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicToolChoice(AnthropicBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicMessagesRequest(AnthropicBaseModel):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    seed: int | None = None   # vLLM's extra (the client's `extra_body`): reproducible sampling

    def chat_request_fields(self) -> dict[str, Any]:
        """The ChatCompletionRequest that serves this request, as a dict of its fields;
        ValueError naming the first thing it cannot express."""
        if self.thinking and self.thinking.get("type") not in (None, "disabled"):
            raise ValueError("thinking: extended thinking is not supported; leave it out (a "
                             "server started with --reasoning-parser separates a model's own "
                             "reasoning).")
        fields: dict[str, Any] = {
            "model": self.model, "messages": chat_messages(self.system, self.messages),
            "max_completion_tokens": self.max_tokens, "stop": self.stop_sequences,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "seed": self.seed, "stream": self.stream}
        if self.stream:   # every chunk then knows the usage so far (message_start needs it)
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description or "",
                "parameters": t.input_schema}} for t in self.tools]
        if self.tool_choice is not None:
            fields.update(_tool_choice(self.tool_choice, bool(self.tools)))
        return fields


def _tool_choice(choice: AnthropicToolChoice, has_tools: bool) -> dict[str, Any]:
    if choice.type != "none" and not has_tools:
        raise ValueError("tool_choice: needs `tools`.")
    if choice.type == "tool" and not choice.name:
        raise ValueError('tool_choice: {"type": "tool"} needs the tool\'s `name`.')
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
        {"type": "function", "function": {"name": choice.name}}
    return {"tool_choice": chat, "parallel_tool_calls": not choice.disable_parallel_tool_use}


def chat_messages(system: str | list[dict[str, Any]] | None,
                  messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """Anthropic's system prompt and content blocks as OpenAI chat messages: text blocks join,
    an assistant's tool_use blocks become its tool_calls, a user's tool_result blocks become
    `tool` messages (before the user's own text)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str)
                    else _text_of(system, "system")})
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        out += _blocks_to_messages(message.role, message.content, f"messages[{i}]")
    return out


def _blocks_to_messages(role: str, blocks: list[dict[str, Any]], where: str
                        ) -> list[dict[str, Any]]:
    texts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _BLOCK_TYPES:
            raise ValueError(f"{where}.content[{j}]: block type {kind!r} is not supported; "
                             f"this server takes {', '.join(_BLOCK_TYPES)} blocks (text models).")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                "name": str(block.get("name", "")),
                "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            content = block.get("content", "")
            text = content if isinstance(content, str) else _text_of(content, f"{where}.content")
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": text})
        else:
            raise ValueError(f"{where}.content[{j}]: a {kind} block belongs in "
                             f"{'an assistant' if kind == 'tool_use' else 'a user'} message.")
    message: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return results + ([message] if texts or calls or not results else [])


def _text_of(blocks: Any, where: str) -> str:
    if not isinstance(blocks, list) or not all(
            isinstance(b, dict) and b.get("type") == "text" for b in blocks):
        raise ValueError(f"{where}: expected a string or a list of text blocks.")
    return "\n".join(str(b.get("text", "")) for b in blocks)


class AnthropicCountTokensRequest(AnthropicBaseModel):
    """POST /v1/messages/count_tokens: the prompt a messages request would run."""
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None


def error_body(kind: str, message: str) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": kind, "message": message}}
