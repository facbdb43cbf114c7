"""POST /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank), vLLM's: the relevance of text
pairs, from a cross-encoder (a one-label classification model) or as the cosine of an embedding
model's vectors (`score_utils`, shared with `LLM.score`)."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from minivllm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo, random_uuid
from minivllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from minivllm.entrypoints.openai.serving_engine import OpenAIError
from minivllm.entrypoints.score_utils import (cosine_similarity, cross_encoding_ids, score_kind,
                                              score_pairs)
from minivllm.pooling_params import PoolingParams


class ScoreRequest(OpenAIBaseModel):
    """`text_1` against `text_2` (one against each, or pairwise); vLLM's newer names `queries`
    and `documents` are the same two sides."""
    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    user: str | None = None


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankRequest(OpenAIBaseModel):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int = Field(default=0, ge=0)    # 0: all, best first
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    user: str | None = None


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: dict[str, int]
    results: list[RerankResult]


class OpenAIServingScores(OpenAIServingEmbedding):

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        first = request.text_1 if request.text_1 is not None else request.queries
        second = request.text_2 if request.text_2 is not None else request.documents
        try:
            pairs = score_pairs(first, second)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc
        request_id = f"score-{random_uuid()}"
        result = await self._scores(request, request_id, pairs, raw_request)
        if result is None:
            return Response(status_code=499)   # the client is gone; nobody reads this
        scores, num_tokens = result
        return JSONResponse(ScoreResponse(
            id=request_id, created=int(time.time()), model=self.model_name(request.model),
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)
        ).model_dump(mode="json"))

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        texts = [d if isinstance(d, str) else d.text for d in request.documents]
        request_id = f"rerank-{random_uuid()}"
        result = await self._scores(request, request_id, [(request.query, t) for t in texts],
                                    raw_request)
        if result is None:
            return Response(status_code=499)
        scores, num_tokens = result
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[:request.top_n or None]
        return JSONResponse(RerankResponse(
            id=request_id, model=self.model_name(request.model),
            usage={"total_tokens": num_tokens},
            results=[RerankResult(index=i, document=RerankDocument(text=texts[i]),
                                  relevance_score=scores[i]) for i in order]
        ).model_dump(mode="json"))

    async def _scores(self, request: Any, request_id: str, pairs: list[tuple[str, str]],
                      raw_request: Request) -> tuple[list[float], int] | None:
        """Each pair's score and the tokens run; None when the client left first."""
        lora_request = self.check_model(request.model)
        try:
            kind = score_kind(self.async_llm.engine.vllm_config.model_config)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="model") from exc
        task = "classify" if kind == "cross-encoder" else "embed"
        params = self.pooling_params("Score", PoolingParams(task=task), None)
        if kind == "cross-encoder":
            prompts = [self._prompt(cross_encoding_ids(self.tokenizer, a, b), request)
                       for a, b in pairs]
        else:
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))   # each embedded once
            prompts = [self._prompt(list(self.tokenizer.encode(t)), request) for t in texts]
        finals = await self.run_pooling(request_id, prompts, params, lora_request, raw_request)
        if finals is None:
            return None
        num_tokens = sum(len(f.prompt_token_ids) for f in finals)
        if kind == "cross-encoder":
            return [float(f.outputs.data[0]) for f in finals], num_tokens
        vectors = {t: f.outputs.data for t, f in zip(texts, finals)}
        return [cosine_similarity(vectors[a], vectors[b]) for a, b in pairs], num_tokens

    def _prompt(self, ids: list[int], request: Any) -> list[int]:
        if request.truncate_prompt_tokens is not None:
            ids = ids[-request.truncate_prompt_tokens:]
        self.check_token_ids(ids, param=None, whole=True)   # a pair: no one field to name
        return ids
