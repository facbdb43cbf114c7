"""The FastAPI app (`build_app`) and `run_server`, which `minivllm serve` calls."""

from __future__ import annotations

import argparse
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

import minivllm
from minivllm import envs
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.anthropic.api_router import register_anthropic_routes
from minivllm.entrypoints.openai.cli_args import LoRAModulePath
from minivllm.entrypoints.openai.dev_routes import register_dev_routes, register_profiler_routes
from minivllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from minivllm.entrypoints.openai.server_launch import (check_serve_args,
                                                       configure_logging_and_middleware,
                                                       server_log_level, uvicorn_config)
from minivllm.entrypoints.openai.server_options import (APIKeyMiddleware, CORSOptions,
                                                        RequestIdHeaderMiddleware,
                                                        bind_listen_socket, resolve_api_keys)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_classification import (ClassificationRequest,
                                                                OpenAIServingClassification)
from minivllm.entrypoints.openai.serving_completions import OpenAIServingCompletion
from minivllm.entrypoints.openai.responses_protocol import ResponsesRequest
from minivllm.entrypoints.openai.serving_pooling import OpenAIServingPooling, PoolingRequest
from minivllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from minivllm.entrypoints.openai.serving_score import (OpenAIServingScores, RerankRequest,
                                                       ScoreRequest)
from minivllm.entrypoints.openai.serving_embedding import (EmbeddingRequest, OpenAIServingEmbedding,
                                                           check_generate_runner)
from minivllm.entrypoints.openai.serving_engine import OpenAIError, error_response
from minivllm.entrypoints.openai.serving_models import (LoadLoRAAdapterRequest, OpenAIServingModels,
                                                        UnloadLoRAAdapterRequest)
from minivllm.entrypoints.openai.serving_tokenization import (DetokenizeRequest,
                                                              OpenAIServingTokenization,
                                                              TokenizeRequest)
from minivllm.entrypoints.openai.tool_parsers import TOOL_PARSER_NAMES, get_tool_parser
from minivllm.entrypoints.openai.sagemaker_routes import register_sagemaker_routes
from minivllm.logger import init_logger
from minivllm.transformers_utils.chat_template import resolve_content_format

logger = init_logger(__name__)


def _error_json(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.to_response().model_dump(), status_code=int(error.status),
                        headers=error.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error_json(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers malformed bodies with 400, not FastAPI's 422.
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [p for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                            f"{e.get('msg', '')}" for e in errors) or "Invalid request body."
        param = loc[0] if loc and isinstance(loc[0], str) else None
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in content_type.split(";")[0]:
            message = (f"The request body must be JSON with Content-Type: application/json; got "
                       f"Content-Type: {content_type or '(none)'}.")
            param = None
        elif first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
            where = f" at position {loc[0]}" if loc and isinstance(loc[0], int) else ""
            message, param = f"The body is not valid JSON: {detail}{where}.", None
        return _error_json(OpenAIError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_response(str(exc.detail), HTTPStatus(exc.status_code)).model_dump(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)   # errors outside the routes (middleware)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return _internal_error_json(exc)


def _internal_error_json(exc: Exception) -> JSONResponse:
    logger.exception("Unhandled error in a request handler")
    return _error_json(OpenAIError(f"Internal error: {type(exc).__name__}: {exc}",
                                   HTTPStatus.INTERNAL_SERVER_ERROR))


class _OpenAIRoute(APIRoute):
    """A route that answers its own unexpected errors with the OpenAI-shaped 500. Raised on, they
    reach Starlette's outermost handler, which re-raises after its response, and uvicorn then
    closes the connection: a client's next request on that keep-alive connection was reset."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except (OpenAIError, RequestValidationError, StarletteHTTPException):
                raise   # their own handlers answer them (4xx)
            except Exception as exc:
                return _internal_error_json(exc)
        return run


def build_app(async_llm: AsyncLLM, served_model_name: str | list[str] | None = None, *,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              lora_modules: list[LoRAModulePath] | None = None,
              api_keys: list[str] | None = None, chat_template: str | None = None,
              enable_prompt_tokens_details: bool = False,
              cors: CORSOptions | None = None, return_tokens_as_token_ids: bool = False,
              enable_request_id_headers: bool = False,
              chat_template_content_format: str = "auto",
              response_role: str = "assistant") -> FastAPI:
    """The OpenAI-compatible app around a (started or not) AsyncLLM; starts its loop (and loads
    the `lora_modules` adapters) on startup. `tool_choice: "auto"` needs
    `enable_auto_tool_choice` and a `tool_call_parser` name. `api_keys` (else VLLM_API_KEY):
    /v1 routes need one as a bearer token; `chat_template`: the text that replaces the
    tokenizer's (requests may still pass their own); `enable_prompt_tokens_details`: usage
    reports the prompt tokens the prefix cache served; `cors`: who may call from a browser
    (vLLM's default: any origin); `return_tokens_as_token_ids`: logprobs name tokens by id
    unless a request says otherwise; `enable_request_id_headers`: X-Request-Id on responses;
    `chat_template_content_format`: auto, string or openai (transformers_utils/chat_template);
    `response_role`: the role of chat replies after a generation prompt."""
    resolve_content_format(chat_template_content_format, None)   # a bad value fails here
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(TOOL_PARSER_NAMES)}).")
    tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    models = OpenAIServingModels(async_llm, served_model_name or os.path.basename(
        os.path.normpath(async_llm.model_path or "model")), lora_modules)   # checks the names
    served_model_name = models.served_model_name   # what responses name: the first

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async_llm.start()
        await models.init_static_loras()
        yield
        async_llm.stop()

    app = FastAPI(title="minivllm OpenAI-compatible server", version=minivllm.__version__,
                  lifespan=lifespan)
    app.router.route_class = _OpenAIRoute
    app.state.async_llm = async_llm
    app.state.served_model_name = served_model_name
    app.state.metrics = metrics = ServerMetrics(async_llm, served_model_name)
    app.state.serving_models = models
    servings = _Servings.create(async_llm, served_model_name, models,
                                tool_parser if enable_auto_tool_choice else None)
    for serving in servings.all():
        serving.chat_template = chat_template
        serving.enable_prompt_tokens_details = enable_prompt_tokens_details
        serving.return_tokens_as_token_ids = return_tokens_as_token_ids
        serving.chat_template_content_format = chat_template_content_format
    servings.chat.response_role = response_role
    keys = resolve_api_keys(api_keys, envs.VLLM_API_KEY)
    if keys:
        app.add_middleware(APIKeyMiddleware, api_keys=keys)
    if enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        _add_lora_routes(app, models)
    if envs.VLLM_SERVER_DEV_MODE:
        register_dev_routes(app, async_llm)
    if envs.VLLM_TORCH_PROFILER_DIR:
        register_profiler_routes(app, async_llm)
    # Added last, so outermost: a preflight is answered before the API-key check.
    app.add_middleware(CORSMiddleware, **(cors or CORSOptions()).middleware_kwargs())
    _install_error_handlers(app)
    _add_info_routes(app, async_llm, metrics, served_model_name)
    _add_generate_routes(app, async_llm, servings)
    _add_tokenizer_routes(app, servings.tokenization)
    _add_responses_routes(app, async_llm, servings.responses)
    _add_pooling_routes(app, servings)
    register_sagemaker_routes(app, async_llm, servings, app.state.health)
    register_anthropic_routes(app, servings.chat)
    return app


@dataclass
class _Servings:
    """One handler object per API, sharing the models (`model` may name a LoRA adapter) and the
    model's generation-config defaults."""
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    responses: OpenAIServingResponses
    tokenization: OpenAIServingTokenization
    embedding: OpenAIServingEmbedding
    classification: OpenAIServingClassification
    scores: OpenAIServingScores
    pooling: OpenAIServingPooling

    @classmethod
    def create(cls, async_llm: AsyncLLM, name: str, models: OpenAIServingModels,
               tool_parser: Any) -> _Servings:
        servings = cls(
            OpenAIServingCompletion(async_llm, name),
            OpenAIServingChat(async_llm, name, tool_parser=tool_parser),
            OpenAIServingResponses(async_llm, name, tool_parser=tool_parser,
                                   enable_store=envs.VLLM_ENABLE_RESPONSES_API_STORE),
            OpenAIServingTokenization(async_llm, name), OpenAIServingEmbedding(async_llm, name),
            OpenAIServingClassification(async_llm, name), OpenAIServingScores(async_llm, name),
            OpenAIServingPooling(async_llm, name))
        model_config = getattr(getattr(async_llm.engine, "vllm_config", None), "model_config",
                               None)
        defaults = model_config.get_diff_sampling_param() if model_config is not None else {}
        if defaults:
            logger.info("Requests default to the model's generation config: %s "
                        "(--generation-config vllm turns this off)", defaults)
        for serving in servings.all():
            serving.models = models
            serving.default_sampling_params = defaults
        return servings

    def all(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]


def _add_generate_routes(app: FastAPI, async_llm: AsyncLLM, servings: _Servings) -> None:
    """/v1/completions, /v1/chat/completions and /v1/embeddings."""

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        check_generate_runner(async_llm, "Completions")
        return await servings.completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        check_generate_runner(async_llm, "Chat Completions")
        return await servings.chat.create_chat_completion(request, raw_request)

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await servings.embedding.create_embedding(request, raw_request)


def _add_info_routes(app: FastAPI, async_llm: AsyncLLM, metrics: ServerMetrics,
                     served_model_name: str) -> None:
    """/health, /version, /metrics and /v1/models."""

    @app.get("/health")
    async def health() -> Response:
        problem = async_llm.check_health()
        if problem is not None:
            return _error_json(OpenAIError(problem, HTTPStatus.SERVICE_UNAVAILABLE))
        return Response(status_code=200)

    app.state.health = health

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": minivllm.__version__}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return app.state.serving_models.show_available_models().model_dump()


def _add_responses_routes(app: FastAPI, async_llm: AsyncLLM,
                          responses: OpenAIServingResponses) -> None:
    """/v1/responses and, for stored responses, /v1/responses/{id} and its /cancel."""

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        check_generate_runner(async_llm, "Responses")
        return await responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return await responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        return await responses.cancel(response_id)


def _add_pooling_routes(app: FastAPI, servings: _Servings) -> None:
    """vLLM's /pooling, /classify, /score and /rerank (each also under the paths vLLM serves
    it)."""

    @app.post("/pooling")
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
        return await servings.pooling.create_pooling(request, raw_request)

    @app.post("/classify")
    async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
        return await servings.classification.create_classify(request, raw_request)

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        return await servings.scores.create_score(request, raw_request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
        return await servings.scores.create_rerank(request, raw_request)


def _add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        return Response(await models.load_lora_adapter(request), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        return Response(await models.unload_lora_adapter(request), media_type="text/plain")


def _add_tokenizer_routes(app: FastAPI, tokenization: OpenAIServingTokenization) -> None:
    """/tokenize and /detokenize."""

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict[str, Any]:
        return tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict[str, Any]:
        return tokenization.detokenize(request)


def run_server(args: argparse.Namespace) -> int:
    """Builds the engine from the CLI flags, then serves until interrupted."""
    import uvicorn

    engine_args = EngineArgs.from_cli_args(args)
    chat_template = check_serve_args(args, engine_args)     # bad flags fail before loading
    server_log_level()
    sock = bind_listen_socket(args.host, args.port)           # so does a port in use
    try:
        async_llm = AsyncLLM.from_engine_args(engine_args,
                                              stall_timeout_s=args.health_stall_timeout)
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(async_llm, args.served_model_name, enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser, lora_modules=args.lora_modules,
                        api_keys=args.api_key, chat_template=chat_template,
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        enable_request_id_headers=args.enable_request_id_headers,
                        chat_template_content_format=args.chat_template_content_format,
                        response_role=args.response_role,
                        cors=CORSOptions(args.allowed_origins, args.allow_credentials,
                                         args.allowed_methods, args.allowed_headers))
        configure_logging_and_middleware(app, async_llm, args)
    except BaseException:
        async_llm.shutdown()
        sock.close()
        raise
    server = uvicorn.Server(uvicorn_config(app, args))
    scheme = "https" if args.ssl_certfile else "http"
    print(f"Serving {app.state.served_model_name} on {scheme}://{args.host}:"
          f"{sock.getsockname()[1]}{args.root_path} (OpenAI API under /v1)", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        async_llm.shutdown()
        sock.close()
    return 0
