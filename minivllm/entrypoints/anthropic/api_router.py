"""The Anthropic routes of the server: POST /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response

from minivllm.entrypoints.anthropic.serving import AnthropicServingMessages
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat


def register_anthropic_routes(app: FastAPI, chat: OpenAIServingChat) -> None:
    messages = AnthropicServingMessages(chat)

    # NOTE: the body is parsed by the handler, so that a malformed one gets Anthropic's error
    # shape rather than the OpenAI-shaped validation error of the other routes.
    @app.post("/v1/messages")
    async def create_message(raw_request: Request) -> Response:
        return await messages.create_message(raw_request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw_request: Request) -> Response:
        return await messages.count_tokens(raw_request)
