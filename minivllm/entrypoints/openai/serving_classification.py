"""POST /classify (vLLM's): class probabilities and the top label per input, on a
sequence-classification model."""

from __future__ import annotations

import time
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from minivllm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo, random_uuid
from minivllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from minivllm.outputs import ClassificationOutput, PoolingRequestOutput
from minivllm.pooling_params import PoolingParams


class ClassificationRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True
    use_activation: bool | None = None   # False: the raw logits
    user: str | None = None


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class OpenAIServingClassification(OpenAIServingEmbedding):

    async def create_classify(self, request: ClassificationRequest,
                              raw_request: Request) -> Response:
        lora_request = self.check_model(request.model)
        params = self.pooling_params("Classification", PoolingParams(
            task="classify", truncate_prompt_tokens=request.truncate_prompt_tokens,
            use_activation=request.use_activation), None)
        request_id = f"classify-{random_uuid()}"
        finals = await self.run_pooling(request_id, self.input_prompts(request), params,
                                        lora_request, raw_request)
        if finals is None:
            return Response(status_code=499)   # the client is gone; nobody reads this
        return JSONResponse(self._classification(request, request_id, finals)
                            .model_dump(mode="json"))

    def _classification(self, request: ClassificationRequest, request_id: str,
                        finals: list[PoolingRequestOutput]) -> ClassificationResponse:
        config = self.async_llm.engine.vllm_config.model_config.hf_config.get_text_config()
        id2label = getattr(config, "id2label", None) or {}
        data = []
        for i, final in enumerate(finals):
            probs = ClassificationOutput.from_base(final.outputs).probs
            top = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=id2label.get(top, f"LABEL_{top}"),
                                           probs=probs, num_classes=len(probs)))
        num_tokens = sum(len(f.prompt_token_ids) for f in finals)
        return ClassificationResponse(id=request_id, created=int(time.time()),
                                      model=self.model_name(request.model), data=data,
                                      usage=UsageInfo(prompt_tokens=num_tokens,
                                                      total_tokens=num_tokens))
