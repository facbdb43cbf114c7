"""SageMaker's two routes, as vLLM serves them (vLLM keeps them in `entrypoints/sagemaker/`):
`/ping` (health, GET or POST) and `/invocations`, one URL for every API: the body's shape picks
the handler.

A generating model takes chat completion bodies (`messages`), then completion bodies
(`prompt`); a pooling model embedding bodies (`input` or `messages`; classification first for
a classifier), then score, rerank and pooling bodies. The first request type the body validates
as serves it, streamed or not, exactly as its own route would.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from minivllm.entrypoints.openai.serving_classification import ClassificationRequest
from minivllm.entrypoints.openai.serving_embedding import EmbeddingRequest, runner_type
from minivllm.entrypoints.openai.serving_engine import OpenAIError
from minivllm.entrypoints.openai.serving_pooling import PoolingRequest
from minivllm.entrypoints.openai.serving_score import RerankRequest, ScoreRequest

Handler = Callable[[Any, Request], Awaitable[Response]]


def register_sagemaker_routes(app: FastAPI, async_llm: AsyncLLM, servings: Any,
                              health: Callable[[], Awaitable[Response]]) -> None:
    """`servings`: the server's handler objects (`api_server._Servings`); `health`: /health's."""

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    @app.post("/invocations")
    async def invocations(raw_request: Request) -> Response:
        body = await _json_object(raw_request)
        candidates = _handlers(async_llm, servings)
        for request_type, handler in candidates:
            try:
                request = request_type.model_validate(body)
            except ValidationError:
                continue
            return await handler(request, raw_request)
        names = ", ".join(_NAMES[t] for t, _ in candidates)
        raise OpenAIError(f"/invocations found no API for this body; this model takes the body "
                          f"of one of: {names}")


_NAMES: dict[type[BaseModel], str] = {
    ChatCompletionRequest: "chat completions (messages)",
    CompletionRequest: "completions (prompt)",
    EmbeddingRequest: "embeddings (input or messages)",
    ClassificationRequest: "classification (input)",
    ScoreRequest: "score (text_1 and text_2, or queries and documents)",
    RerankRequest: "rerank (query and documents)",
    PoolingRequest: "pooling (input)",
}


def _handlers(async_llm: AsyncLLM, servings: Any) -> list[tuple[type[BaseModel], Handler]]:
    if runner_type(async_llm) != "pooling":
        return [(ChatCompletionRequest, servings.chat.create_chat_completion),
                (CompletionRequest, servings.completions.create_completion)]
    model_config = async_llm.engine.vllm_config.model_config
    first = [(EmbeddingRequest, servings.embedding.create_embedding),
             (ClassificationRequest, servings.classification.create_classify)]
    if model_config.pooling_task == "classify":
        first.reverse()
    return first + [(ScoreRequest, servings.scores.create_score),
                    (RerankRequest, servings.scores.create_rerank),
                    (PoolingRequest, servings.pooling.create_pooling)]


async def _json_object(raw_request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await raw_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"/invocations takes a JSON object; the body is not JSON: {exc}")
    if not isinstance(body, dict):
        raise OpenAIError("/invocations takes a JSON object, got "
                          f"{type(body).__name__}")
    return body
