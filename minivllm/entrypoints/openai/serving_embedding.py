"""POST /v1/embeddings: one pooling request per input, floats or base64 (OpenAI's shapes)."""

from __future__ import annotations

import asyncio
import base64
import time
from contextlib import aclosing
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from minivllm.engine.async_llm import AsyncLLM, RequestStream
from minivllm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo, random_uuid
from minivllm.entrypoints.openai.serving_engine import (OpenAIError, OpenAIServing, engine_error,
                                                        run_until_disconnect)
from minivllm.outputs import EmbeddingOutput, PoolingRequestOutput
from minivllm.pooling_params import PoolingParams


class EmbeddingRequest(OpenAIBaseModel):
    """OpenAI's body, plus vLLM's `truncate_prompt_tokens` and `add_special_tokens`, and its
    chat form: `messages` (instead of `input`) through the chat template, one embedding."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str    # floats, or base64 of little-endian float32


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


def runner_type(async_llm: AsyncLLM) -> str:
    """The engine's runner ("generate" or "pooling"); "generate" for engines without one."""
    model_config = getattr(getattr(async_llm.engine, "vllm_config", None), "model_config", None)
    return getattr(model_config, "runner_type", "generate")


def check_generate_runner(async_llm: AsyncLLM, api: str) -> None:
    """A 400 (as vLLM's) when a text API is asked of an embedding model."""
    if runner_type(async_llm) == "pooling":
        raise OpenAIError(f"The model does not support the {api} API: it is a pooling model "
                          "(runner='pooling'); use /v1/embeddings, /classify, /score or "
                          "/rerank, as the model allows.")


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64 form is the little-endian float32 bytes of the vector."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


class OpenAIServingEmbedding(OpenAIServing):

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        lora_request = self.check_model(request.model)
        params = self.pooling_params(
            "Embeddings", PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens,
                                        dimensions=request.dimensions), "dimensions")
        request_id = f"embd-{random_uuid()}"
        finals = await self.run_pooling(request_id, self.input_prompts(request), params,
                                        lora_request, raw_request)
        if finals is None:
            return Response(status_code=499)   # the client is gone; nobody reads this
        return JSONResponse(self._response(request, request_id, finals).model_dump(mode="json"))

    def pooling_params(self, api: str, params: PoolingParams, param: str | None) -> PoolingParams:
        """`params` checked against the served model (a 400 naming `param` when it does not
        fit); the API needs the pooling runner."""
        if runner_type(self.async_llm) != "pooling":
            raise OpenAIError(f"The model does not support the {api} API: it runs with "
                              "runner='generate'. Serve a pooling model, or start the server "
                              "with --runner pooling (and --convert embed or classify for a "
                              "causal LM).")
        try:
            params.verify(self.async_llm.engine.vllm_config.model_config)
        except ValueError as exc:   # the field's own check names it first; a task mismatch not
            named = param is not None and str(exc).startswith(param)
            raise OpenAIError(str(exc), param=param if named else None) from exc
        return params

    async def run_pooling(self, request_id: str, prompts: list[list[int]], params: PoolingParams,
                          lora_request: Any, raw_request: Request
                          ) -> list[PoolingRequestOutput] | None:
        """Each prompt's pooled output, in order; None when the client left first."""
        streams = self.add_requests([(f"{request_id}-{i}", ids, params)
                                     for i, ids in enumerate(prompts)], lora_request)
        try:
            return await run_until_disconnect(raw_request, _collect(streams))
        except Exception as exc:
            raise engine_error(exc) from exc

    def input_prompts(self, request: Any) -> list[list[int]]:
        """Token ids per input of a pooling request (its `input`, `add_special_tokens`,
        `truncate_prompt_tokens`): a string, strings, token ids, or lists of token ids; or
        one conversation (`messages`) through the chat template."""
        if getattr(request, "messages", None) is not None:
            if request.input is not None:
                raise OpenAIError("Give `input` or `messages`, not both.", param="messages")
            ids = self.render_chat(request.messages, request.chat_template,
                                   add_generation_prompt=request.add_generation_prompt,
                                   continue_final_message=request.continue_final_message,
                                   chat_template_kwargs=request.chat_template_kwargs)
            if request.truncate_prompt_tokens is not None:
                ids = ids[-request.truncate_prompt_tokens:]
            self.check_token_ids(ids, param="messages", whole=True)
            return [ids]
        value = request.input
        if value is None:
            raise OpenAIError("Give `input` (or `messages` for a chat).", param="input")
        items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) \
            else list(value)
        if not items:
            raise OpenAIError("The input is empty; give a string, a list of strings, token ids "
                              "or a list of token-id lists.", param="input")
        prompts = []
        for item in items:
            ids = list(self.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)) \
                if isinstance(item, str) else list(item)
            if request.truncate_prompt_tokens is not None:
                ids = ids[-request.truncate_prompt_tokens:]
            self.check_token_ids(ids, param="input", whole=True)
            prompts.append(ids)
        return prompts

    def _response(self, request: EmbeddingRequest, request_id: str,
                  finals: list[PoolingRequestOutput]) -> EmbeddingResponse:
        data = []
        for i, final in enumerate(finals):
            try:
                embedding = EmbeddingOutput.from_base(final.outputs).embedding
            except ValueError as exc:   # token-wise (ALL) pooling has no single vector
                raise OpenAIError(str(exc)) from exc
            data.append(EmbeddingResponseData(
                index=i, embedding=encode_embedding(embedding, request.encoding_format)))
        num_tokens = sum(len(f.prompt_token_ids) for f in finals)
        return EmbeddingResponse(id=request_id, created=int(time.time()),
                                 model=self.model_name(request.model), data=data,
                                 usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))


async def _collect(streams: list[RequestStream]) -> list[PoolingRequestOutput]:
    """Each request's one (final) output, in order; cancelling aborts the unfinished ones."""

    async def final(stream: RequestStream) -> Any:
        last = None
        async with aclosing(stream.outputs()) as outputs:
            async for output in outputs:
                last = output
        return last

    return list(await asyncio.gather(*(final(s) for s in streams)))
