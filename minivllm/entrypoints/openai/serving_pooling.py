"""POST /pooling (vLLM's): whatever the model's pooler returns, per input (an embedding, class
logits, or one vector per token for token-wise pooling), without the task's post-processing."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from minivllm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo, random_uuid
from minivllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from minivllm.pooling_params import PoolingParams


class PoolingRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True
    user: str | None = None


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[Any]    # [H], or [n, H] per token


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class OpenAIServingPooling(OpenAIServingEmbedding):

    async def create_pooling(self, request: PoolingRequest, raw_request: Request) -> Response:
        lora_request = self.check_model(request.model)
        params = self.pooling_params("Pooling", PoolingParams(
            task="encode", truncate_prompt_tokens=request.truncate_prompt_tokens), None)
        request_id = f"pool-{random_uuid()}"
        finals = await self.run_pooling(request_id, self.input_prompts(request), params,
                                        lora_request, raw_request)
        if finals is None:
            return Response(status_code=499)   # the client is gone; nobody reads this
        num_tokens = sum(len(f.prompt_token_ids) for f in finals)
        return JSONResponse(PoolingResponse(
            id=request_id, created=int(time.time()), model=self.model_name(request.model),
            data=[PoolingResponseData(index=i, data=f.outputs.data.tolist())
                  for i, f in enumerate(finals)],
            usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)
        ).model_dump(mode="json"))
