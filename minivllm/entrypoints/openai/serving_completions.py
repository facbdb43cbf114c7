"""POST /v1/completions: one engine request per prompt, n choices each, JSON or SSE."""

from __future__ import annotations

import base64
import dataclasses
import io
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.engine.async_llm import RequestStream
from minivllm.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest,
                                                  CompletionResponse, CompletionResponseChoice,
                                                  UsageInfo)
from minivllm.entrypoints.openai.serving_engine import (ChunkEncoder, OpenAIError, OpenAIServing,
                                                        clamp_logprob, engine_error, merge_streams,
                                                        prompt_logprobs_entries,
                                                        run_until_disconnect, sse_error, usage_dict)
from minivllm.inputs import EmbedsPrompt
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class _Prompt:
    text: str           # for echo
    token_ids: list[int]   # stand-in zeros, one per position, for a prompt given as embeddings
    embeds: torch.Tensor | None = None   # [L, H]: a `prompt_embeds` prompt

    @property
    def engine_prompt(self) -> list[int] | EmbedsPrompt:
        return self.token_ids if self.embeds is None else EmbedsPrompt(prompt_embeds=self.embeds)

    @property
    def known_token_ids(self) -> list[int] | None:
        return self.token_ids if self.embeds is None else None


@dataclass
class _ChoiceState:
    """What one streamed choice has sent so far."""

    num_chars: int = 0       # of the completion text (without echo)
    num_tokens: int = 0      # tokens whose logprobs were sent
    text_offset: int = 0     # characters sent, echo included
    echoed: bool = False
    finished: bool = False
    num_completion_tokens: int = 0
    num_ids_sent: int = 0    # return_token_ids


@dataclass
class _Job:
    request: CompletionRequest
    request_id: str
    created: int
    prompts: list[_Prompt]
    streams: list[RequestStream] = field(default_factory=list)
    # echo with max_tokens=0 (lm-eval's loglikelihood): one token is computed for the prompt's
    # logprobs and dropped from the answer.
    echo_only: bool = False


class OpenAIServingCompletion(OpenAIServing):

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        lora_request = self.check_model(request.model)
        job = _Job(request, f"cmpl-{self.base_request_id(raw_request, request)}", int(time.time()),
                   self._prompts(request),
                   echo_only=request.echo and request.max_tokens == 0)
        max_tokens = [1 if job.echo_only else self.resolve_max_tokens(len(p.token_ids),
                                                                      request.max_tokens)
                      for p in job.prompts]
        if request.use_beam_search:
            job.streams = self.beam_search_streams(request, [p.token_ids for p in job.prompts],
                                                   max_tokens, job.request_id, lora_request)
        else:
            job.streams = self.add_requests(
                [(f"{job.request_id}-{i}", p.engine_prompt, self.sampling_params(request, m))
                 for i, (p, m) in enumerate(zip(job.prompts, max_tokens))], lora_request,
                request.priority, request.cache_salt)
        if request.stream:
            return StreamingResponse(self._stream(job), media_type="text/event-stream")
        try:
            finals = await run_until_disconnect(raw_request, self._collect(job.streams))
        except Exception as exc:
            raise engine_error(exc) from exc
        if finals is None:
            return Response(status_code=499)   # the client is gone; nobody reads this
        if job.echo_only:
            finals = [_without_completion(f) for f in finals]
        return JSONResponse(self._response(job, finals).model_dump(mode="json"))

    def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        """`prompt`'s then `prompt_embeds`' prompts."""
        embeds = request.prompt_embeds
        embeds = [embeds] if isinstance(embeds, str) else list(embeds or [])
        prompts = self._token_prompts(request) if request.prompt is not None else []
        return prompts + [self._embeds_prompt(request, i, data) for i, data in enumerate(embeds)]

    def _token_prompts(self, request: CompletionRequest) -> list[_Prompt]:
        """Each prompt's text and ids (truncated as `truncate_prompt_tokens` asks: the text
        is then the kept tokens')."""
        prompt = request.prompt
        items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) \
            else list(prompt)
        if not items:
            raise OpenAIError("The prompt is empty.", param="prompt")
        prompts = []
        for item in items:
            ids = list(self.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)) \
                if isinstance(item, str) else list(item)
            kept = self.truncate_prompt(ids, request)
            self.check_token_ids(kept)
            if isinstance(item, str) and len(kept) == len(ids):
                prompts.append(_Prompt(item, ids))
            else:
                text = self.async_llm.tokenizer.decode(kept) if self.async_llm.tokenizer else ""
                prompts.append(_Prompt(text, kept))
        return prompts

    def _embeds_prompt(self, request: CompletionRequest, index: int, data: str) -> _Prompt:
        """vLLM's form: base64 of a torch.save'd float tensor [num_tokens, H] (the engine's
        checks apply: --enable-prompt-embeds, the hidden size, max_model_len, truncation)."""
        processor = self.async_llm.engine.input_processor
        if not processor.enable_prompt_embeds:   # before decoding what would be refused
            raise OpenAIError("prompt_embeds needs a server started with --enable-prompt-embeds.",
                              param="prompt_embeds")
        for name in ("echo", "use_beam_search"):
            if getattr(request, name):
                raise OpenAIError(f"{name} is not supported with prompt_embeds.", param=name)
        try:
            tensor = torch.load(io.BytesIO(base64.b64decode(data, validate=True)),
                                weights_only=True, map_location="cpu")
        except Exception as exc:   # noqa: BLE001 - any decoding failure is the client's
            raise OpenAIError(f"prompt_embeds[{index}] is not a base64-encoded tensor saved "
                              f"with torch.save: {exc}", param="prompt_embeds") from None
        if isinstance(tensor, torch.Tensor) and tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        try:
            processed = processor.process(EmbedsPrompt(prompt_embeds=tensor), request)
        except ValueError as exc:
            raise OpenAIError(f"prompt_embeds[{index}]: {exc}", param="prompt_embeds") from exc
        return _Prompt("", processed.token_ids, processed.embeds)

    @staticmethod
    async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async with aclosing(merge_streams(streams)) as merged:
            async for i, output in merged:
                finals[i] = output
        return finals   # type: ignore[return-value]

    def _response(self, job: _Job, finals: list[RequestOutput]) -> CompletionResponse:
        request = job.request
        choices = []
        num_prompt_tokens = num_completion_tokens = 0
        for i, (prompt, final) in enumerate(zip(job.prompts, finals)):
            num_prompt_tokens += len(prompt.token_ids)
            prompt_logprobs = None if request.prompt_logprobs is None else \
                prompt_logprobs_entries(final, self.decode_tokens)
            for out in final.outputs:
                num_completion_tokens += len(out.token_ids)
                text, logprobs = out.text, None
                if request.echo:
                    text = prompt.text + text
                if request.logprobs is not None:
                    ids, steps = self._logprob_inputs(prompt, final, out, echo=request.echo)
                    logprobs = self._logprobs(ids, steps, 0, self.tokens_as_ids(request))
                ids = request.return_token_ids
                choices.append(CompletionResponseChoice(
                    index=i * request.n + out.index, text=text, logprobs=logprobs,
                    finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                    prompt_logprobs=prompt_logprobs,
                    prompt_token_ids=prompt.known_token_ids if ids else None,
                    token_ids=list(out.token_ids) if ids else None))
        return CompletionResponse(
            id=job.request_id, created=job.created, model=self.model_name(request.model),
            choices=choices,
            usage=UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                            total_tokens=num_prompt_tokens + num_completion_tokens,
                            prompt_tokens_details=self.prompt_tokens_details(
                                sum(f.num_cached_tokens for f in finals))))

    async def _stream(self, job: _Job) -> AsyncIterator[str]:
        request, n = job.request, job.request.n
        states = [_ChoiceState(echoed=not request.echo) for _ in range(len(job.prompts) * n)]
        encoder = ChunkEncoder(job.request_id, "text_completion", job.created,
                               self.model_name(request.model))
        num_prompt = sum(len(p.token_ids) for p in job.prompts)
        cached = [0] * len(job.prompts)   # each prompt's prefix-cache hits

        def usage() -> dict[str, Any]:   # the request's so far: all prompts and choices
            return usage_dict(num_prompt, sum(s.num_completion_tokens for s in states),
                              self.prompt_tokens_details(sum(cached)))
        try:
            async with aclosing(merge_streams(job.streams)) as merged:
                async for i, output in merged:
                    cached[i] = output.num_cached_tokens
                    if job.echo_only:
                        output = _without_completion(output)
                    for out in output.outputs:
                        choice = self._stream_choice(job, i, output, out, states[i * n + out.index])
                        if choice is not None:
                            yield encoder.chunk([choice],
                                                usage() if request.continuous_usage else None)
            if request.include_usage:
                yield encoder.chunk([], usage())
        except Exception as exc:   # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(exc)
        yield "data: [DONE]\n\n"

    def _stream_choice(self, job: _Job, i: int, final: RequestOutput, out: CompletionOutput,
                       state: _ChoiceState) -> dict[str, Any] | None:
        """The new part of one choice since the last chunk (a CompletionResponseChoice as a
        dict), or None when nothing changed."""
        if state.finished:
            return None
        prompt, request = job.prompts[i], job.request
        state.num_completion_tokens = len(out.token_ids)
        echo_now = not state.echoed
        delta = out.text[state.num_chars:]
        state.num_chars = max(state.num_chars, len(out.text))
        text = (prompt.text if echo_now else "") + delta
        logprobs = None
        if request.logprobs is not None:
            ids, steps = self._logprob_inputs(prompt, final, out, echo=echo_now)
            skip = 0 if echo_now else state.num_tokens
            if ids[skip:]:
                logprobs = self._logprobs(ids[skip:], steps[skip:], state.text_offset,
                                          self.tokens_as_ids(request))
            state.num_tokens = len(out.token_ids)
        state.echoed = True
        state.finished = out.finish_reason is not None
        if not text and logprobs is None and not state.finished:
            return None
        state.text_offset += len(text)
        choice = {"index": i * request.n + out.index, "text": text,
                  "logprobs": logprobs.model_dump(mode="json") if logprobs is not None else None,
                  "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if request.return_token_ids:   # the prompt's with the first chunk, then the new ids
            if state.num_ids_sent == 0:
                choice["prompt_token_ids"] = prompt.known_token_ids
            choice["token_ids"] = list(out.token_ids[state.num_ids_sent:])
            state.num_ids_sent = len(out.token_ids)
        return choice

    @staticmethod
    def _logprob_inputs(prompt: _Prompt, final: RequestOutput, out: CompletionOutput,
                        echo: bool) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """Token ids and their per-position logprob dicts, the prompt's first when echoed."""
        ids, steps = list(out.token_ids), list(out.logprobs or [])
        steps += [None] * (len(ids) - len(steps))
        if echo:
            prompt_steps = list(final.prompt_logprobs or [])
            prompt_steps += [None] * (len(prompt.token_ids) - len(prompt_steps))
            ids = prompt.token_ids + ids
            steps = prompt_steps[:len(prompt.token_ids)] + steps
        return ids, steps

    def _logprobs(self, token_ids: list[int], steps: list[dict[int, Logprob] | None],
                  text_offset: int, as_ids: bool = False) -> CompletionLogProbs:
        """OpenAI's completions shape: parallel lists of tokens, logprobs, top-k and offsets.
        `as_ids`: tokens are named "token_id:<id>" (offsets still count the text)."""
        result = CompletionLogProbs()
        for token_id, step in zip(token_ids, steps):
            entry = step.get(token_id) if step else None
            token = entry.decoded_token if entry and entry.decoded_token is not None \
                else self._token_str(token_id)
            result.tokens.append(f"token_id:{token_id}" if as_ids else token)
            result.text_offset.append(text_offset)
            text_offset += len(token)
            if entry is None:   # the first prompt token: nothing predicts it
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(clamp_logprob(entry.logprob))
            result.top_logprobs.append({
                (f"token_id:{tid}" if as_ids else lp.decoded_token if lp.decoded_token is not None
                 else self._token_str(tid)): clamp_logprob(lp.logprob) for tid, lp in step.items()})
        return result

    def _token_str(self, token_id: int) -> str:
        tokenizer = self.async_llm.tokenizer
        if tokenizer is None:
            return f"token_id:{token_id}"
        token = tokenizer.convert_ids_to_tokens(token_id)
        return tokenizer.convert_tokens_to_string([token]) if token is not None else ""


def _without_completion(output: RequestOutput) -> RequestOutput:
    """The output of an echo-only request: the prompt's part, no generated token."""
    outputs = [dataclasses.replace(o, text="", token_ids=[], cumulative_logprob=None,
                                   logprobs=[] if o.logprobs is not None else None,
                                   finish_reason="length" if o.finish_reason else None,
                                   stop_reason=None) for o in output.outputs]
    return dataclasses.replace(output, outputs=outputs)
