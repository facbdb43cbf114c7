"""vLLM's development routes (`VLLM_SERVER_DEV_MODE=1`): `POST /reset_prefix_cache`,
`POST /collective_rpc` (a Worker method by name on every rank), `GET /server_info`, sleep mode's
`POST /sleep?level=N`, `POST /wake_up?tags=...` and `GET /is_sleeping`; `POST /pause`,
`POST /resume` and `GET /is_paused` (RL weight updates); and the
profiler's `/start_profile` and `/stop_profile` (when VLLM_TORCH_PROFILER_DIR is set). They
reach into the engine, so they are off unless asked for, and the API key guards them when set
(APIKeyMiddleware checks /v1 only: these paths are meant for a trusted operator)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import Field

import minivllm
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.protocol import OpenAIBaseModel
from minivllm.entrypoints.openai.serving_engine import OpenAIError


class CollectiveRPCRequest(OpenAIBaseModel):
    method: str = Field(min_length=1)   # a Worker method's name (functions do not travel as JSON)
    timeout: float | None = Field(default=None, gt=0)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


def register_profiler_routes(app: FastAPI, async_llm: AsyncLLM) -> None:
    """vLLM's /start_profile and /stop_profile, registered when VLLM_TORCH_PROFILER_DIR is set:
    every rank's torch profiler, its traces written to that folder on stop."""

    for name in ("start_profile", "stop_profile"):
        app.add_api_route(f"/{name}", _profiler_call(async_llm, name), methods=["POST"])


def _profiler_call(async_llm: AsyncLLM, name: str):
    async def call() -> Response:
        try:
            await getattr(async_llm, name)()
        except ValueError as exc:   # already running / not running
            raise OpenAIError(str(exc), HTTPStatus.CONFLICT) from exc
        return Response(status_code=200)
    return call


def register_dev_routes(app: FastAPI, async_llm: AsyncLLM) -> None:

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not await async_llm.reset_prefix_cache():
            raise OpenAIError("The prefix cache cannot be reset while requests hold KV blocks; "
                              "retry when the server is idle.", HTTPStatus.CONFLICT)
        return Response(status_code=200)

    @app.post("/collective_rpc")
    async def collective_rpc(request: CollectiveRPCRequest) -> JSONResponse:
        if request.method.startswith("_"):
            raise OpenAIError(f"{request.method!r} is private; name a public Worker method.",
                              param="method")
        try:
            results = await async_llm.collective_rpc(request.method, request.timeout,
                                                     tuple(request.args), request.kwargs)
        except (ValueError, TypeError) as exc:   # an unknown method, wrong arguments
            raise OpenAIError(f"collective_rpc {request.method!r} failed: {exc}",
                              param="method") from exc
        try:
            return JSONResponse({"results": jsonable_encoder(results)})
        except (TypeError, ValueError) as exc:
            raise OpenAIError(f"{request.method!r} returned a result that is not JSON: {exc}",
                              param="method") from exc

    register_sleep_routes(app, async_llm)
    register_pause_routes(app, async_llm)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        config = getattr(async_llm.engine, "vllm_config", None)
        return {"version": minivllm.__version__, "vllm_config": str(config)}


def register_sleep_routes(app: FastAPI, async_llm: AsyncLLM) -> None:
    """vLLM's sleep mode routes: a bad level or tag is a 400 naming the valid ones; sleeping
    while requests run (or without --enable-sleep-mode) a 409."""

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        if raw not in ("1", "2"):
            raise OpenAIError(f"level must be 1 or 2, got {raw!r}", param="level")
        try:
            await async_llm.sleep(int(raw))
        except ValueError as exc:
            raise OpenAIError(str(exc), HTTPStatus.CONFLICT) from exc
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        try:
            await async_llm.wake_up(tags)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="tags") from exc
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await async_llm.is_sleeping()}


def register_pause_routes(app: FastAPI, async_llm: AsyncLLM) -> None:
    """vLLM's /pause?wait_for_inflight_requests=false&clear_cache=true, /resume, /is_paused:
    while paused, new requests wait (they are not refused)."""

    @app.post("/pause")
    async def pause(request: Request) -> Response:
        flags = {name: _query_bool(request, name, default)
                 for name, default in (("wait_for_inflight_requests", False),
                                       ("clear_cache", True))}
        await async_llm.pause_generation(**flags)
        return Response(status_code=200)

    @app.post("/resume")
    async def resume() -> Response:
        await async_llm.resume_generation()
        return Response(status_code=200)

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": await async_llm.is_paused()}


def _query_bool(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw.lower() not in ("true", "false", "1", "0"):
        raise OpenAIError(f"{name} must be true or false, got {raw!r}", param=name)
    return raw.lower() in ("true", "1")
