"""What completions, chat and tokenize share: errors, model check, prompt checks, admission."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request

from minivllm.engine.async_llm import (AsyncLLM, EngineDeadError, QueueFullError,
                                                      RequestStream)
from minivllm.engine.beam_search_stream import BeamSearchStream
from minivllm.engine.pause_mixin import GenerationAborted
from minivllm.entrypoints.openai.protocol import (ErrorInfo, ErrorResponse, PromptLogprob,
                                                  PromptLogprobs, random_uuid)
from minivllm.inputs import PromptType, TokensPrompt, check_prompt_token_ids, truncate_prompt
from minivllm.lora.request import LoRARequest
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams
from minivllm.transformers_utils.chat_template import (chat_template_arguments, chat_token_ids,
                                                      normalize_messages, resolve_content_format)
from minivllm.v1.structured_output import validate_structured_outputs

T = TypeVar("T")
# Logprobs of -inf are not valid JSON; vLLM clamps them the same way.
MIN_LOGPROB = -9999.0
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class OpenAIError(Exception):
    """Becomes an OpenAI-shaped JSON error with this HTTP status."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers

    def to_response(self) -> ErrorResponse:
        return error_response(self.message, self.status, self.param)


def error_response(message: str, status: HTTPStatus, param: str | None = None) -> ErrorResponse:
    # vLLM's type names: "BadRequestError", "NotFoundError", ...
    kind = "".join(w.capitalize() for w in status.phrase.split()) + "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind.replace("ErrorError", "Error"),
                                         param=param, code=int(status)))


def engine_error(exc: BaseException) -> OpenAIError:
    """Maps what AsyncLLM raises to the HTTP error a client should see."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, QueueFullError):
        return OpenAIError(str(exc), HTTPStatus.TOO_MANY_REQUESTS,
                           headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, (EngineDeadError, GenerationAborted)):
        return OpenAIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(exc, ValueError):
        return OpenAIError(str(exc), HTTPStatus.BAD_REQUEST)
    return OpenAIError(f"Internal error: {type(exc).__name__}: {exc}",
                       HTTPStatus.INTERNAL_SERVER_ERROR)


def sse_error(exc: BaseException) -> str:
    """An error inside an already-started stream: one event with the error object."""
    return f"data: {engine_error(exc).to_response().model_dump_json()}\n\n"


# Request fields that change what sampling does but that beam search does not apply, with their
# defaults: given with use_beam_search, a 400 names them.
_NOT_WITH_BEAM_SEARCH: dict[str, Any] = {
    "logprobs": None, "top_logprobs": None, "echo": False, "stop": None, "stop_token_ids": None,
    "min_tokens": 0, "logit_bias": None, "allowed_token_ids": None, "bad_words": None,
    "structured_outputs": None, "response_format": None, "tools": None, "top_p": None,
    "top_k": None, "min_p": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": None, "prompt_logprobs": None, "priority": 0, "cache_salt": None}


class OpenAIServing:
    def __init__(self, async_llm: AsyncLLM, served_model_name: str) -> None:
        self.async_llm = async_llm
        self.served_model_name = served_model_name
        self.max_model_len = async_llm.max_model_len
        # An OpenAIServingModels (set by build_app): the base model and its LoRA adapters.
        self.models: Any = None
        self.chat_template: str | None = None   # --chat-template: in place of the tokenizer's
        self.chat_template_content_format = "auto"   # --chat-template-content-format
        self.enable_prompt_tokens_details = False   # usage reports the prefix-cached tokens
        self.return_tokens_as_token_ids = False      # --return-tokens-as-token-ids
        # The model's generation-config defaults for what requests leave unset (vLLM's; set by
        # build_app).
        self.default_sampling_params: dict[str, Any] = {}

    @property
    def tokenizer(self) -> Any:
        if self.async_llm.tokenizer is None:
            raise OpenAIError("This model has no tokenizer; only token-id prompts work.")
        return self.async_llm.tokenizer

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 when unknown."""
        if self.models is not None:
            return self.models.resolve(model)
        if model is not None and model not in (self.served_model_name, self.async_llm.model_path):
            raise OpenAIError(f"The model `{model}` does not exist; this server serves "
                              f"`{self.served_model_name}`.", HTTPStatus.NOT_FOUND, "model")
        return None

    def model_name(self, requested: str | None) -> str:
        """The `model` a response names: the adapter asked for, else the served base model."""
        if self.models is not None and requested in self.models.lora_requests:
            return requested
        return self.served_model_name

    @staticmethod
    def base_request_id(raw_request: Request | None, request: Any) -> str:
        """vLLM's: the X-Request-Id header, else the body's `request_id`, else a new uuid."""
        header = raw_request.headers.get("X-Request-Id") if raw_request is not None else None
        return header or getattr(request, "request_id", None) or random_uuid()

    def tokens_as_ids(self, request: Any) -> bool:
        """Logprobs name tokens "token_id:<id>": the request's choice, else the server's."""
        own = getattr(request, "return_tokens_as_token_ids", None)
        return self.return_tokens_as_token_ids if own is None else own

    def prompt_tokens_details(self, num_cached_tokens: int) -> dict[str, int] | None:
        """vLLM's usage.prompt_tokens_details (with --enable-prompt-tokens-details)."""
        return {"cached_tokens": num_cached_tokens} if self.enable_prompt_tokens_details \
            else None

    def check_token_ids(self, token_ids: list[int], param: str = "prompt",
                        whole: bool = False) -> None:
        """Empty or out-of-vocabulary ids are a 400. `whole`: the prompt is all the request
        runs (pooling), so it must fit max_model_len itself; a generation's length is checked
        with its completion's (resolve_max_tokens)."""
        try:
            check_prompt_token_ids(token_ids, self.async_llm.vocab_size,
                                   self.max_model_len if whole else None)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=param) from exc

    def truncate_prompt(self, token_ids: list[int], request: Any) -> list[int]:
        """The request's `truncate_prompt_tokens` applied (before the length checks)."""
        try:
            return truncate_prompt(token_ids, request.truncate_prompt_tokens, self.max_model_len)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="truncate_prompt_tokens") from exc

    def render_chat(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_special_tokens: bool = False, **options: Any) -> list[int]:
        """Token ids of a conversation through the model's (or the given) chat template;
        `options`: `chat_template_arguments`' (add_generation_prompt, continue_final_message,
        tools, chat_template_kwargs, documents)."""
        tokenizer = self.tokenizer
        chat_template = chat_template or self.chat_template
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise OpenAIError("This model has no chat template; pass `chat_template` or use "
                              "/v1/completions.", param="chat_template")
        try:
            conversation = normalize_messages(messages, resolve_content_format(
                self.chat_template_content_format, chat_template or tokenizer.chat_template))
        except ValueError as exc:
            raise OpenAIError(str(exc), param="messages") from exc
        try:
            kwargs = chat_template_arguments(**options)
        except ValueError as exc:
            raise OpenAIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc
        try:
            return chat_token_ids(tokenizer, conversation, add_special_tokens,
                                  chat_template=chat_template, **kwargs)
        except Exception as exc:   # jinja2 errors, raise_exception() in templates, ...
            raise OpenAIError(f"The chat template failed on these messages: {exc}",
                              param="messages") from exc

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None,
                           param: str = "max_tokens") -> int:
        """Checks prompt + completion against max_model_len, with the real token counts."""
        if num_prompt_tokens >= self.max_model_len:
            raise OpenAIError(f"This model's maximum context length is {self.max_model_len} "
                              f"tokens. However, your prompt has {num_prompt_tokens} tokens. "
                              "Please reduce the length of the prompt.", param="prompt")
        if max_tokens is None:   # the room left, or less where the generation config says
            return min(self.max_model_len - num_prompt_tokens,
                       self.default_sampling_params.get("max_tokens", self.max_model_len))
        if max_tokens >= 1 and num_prompt_tokens + max_tokens > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the prompt, {max_tokens} for the completion). Please reduce the length of the "
                "prompt or the completion.", param=param)
        return max_tokens

    def sampling_params(self, request: Any, max_tokens: int,
                        aliases: dict[str, str] | None = None) -> SamplingParams:
        """`request.to_sampling_params`; a ValueError becomes a 400 naming the field if it can
        (the messages start with the field's name). The output constraint is compiled to a
        grammar and checked here, so a bad schema or regex is a 400 before anything streams."""
        try:
            params = request.to_sampling_params(max_tokens, self.default_sampling_params)
        except ValueError as exc:
            first_word = str(exc).split(" ", 1)[0]
            known = first_word in _SAMPLING_FIELDS or first_word in type(request).model_fields
            param = (aliases or {}).get(first_word, first_word) if known else None
            raise OpenAIError(str(exc), param=param) from exc
        if self.async_llm.vocab_size is not None:
            try:
                params.verify_vocab(self.async_llm.vocab_size)
            except ValueError as exc:
                raise OpenAIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc
        try:   # the engine's --max-logprobs; chat's logprobs count is its top_logprobs
            params.verify_logprobs(getattr(self.async_llm.engine, "max_logprobs", MAX_LOGPROBS))
        except ValueError as exc:
            name = str(exc).split(" ", 2)[1]       # "Requested <field> of ..."
            if name == "logprobs" and "top_logprobs" in type(request).model_fields:
                name = "top_logprobs"
            raise OpenAIError(str(exc), param=(aliases or {}).get(name, name)) from exc
        if params.structured_outputs is not None:
            try:
                validate_structured_outputs(params.structured_outputs)
            except ValueError as exc:
                raise OpenAIError(str(exc), param="structured_outputs" if request.structured_outputs
                                  else "response_format") from exc
        return params

    def beam_search_streams(self, request: Any, prompts: list[list[int]], max_tokens: list[int],
                            request_id: str, lora_request: LoRARequest | None
                            ) -> list[BeamSearchStream]:
        """vLLM's `use_beam_search`: per prompt the best n beams (n the beam width) as its n
        choices. Options the search does not apply are refused (vLLM ignores them)."""
        for name, default in _NOT_WITH_BEAM_SEARCH.items():
            value = getattr(request, name, default)
            if value not in (default, None, False) and getattr(value, "type", None) != "text":
                raise OpenAIError(f"{name} is not supported with use_beam_search.", param=name)
        if request.n > MAX_LOGPROBS // 2:
            raise OpenAIError(f"n (the beam width with use_beam_search) must be at most "
                              f"{MAX_LOGPROBS // 2}, got {request.n}.", param="n")
        try:
            params = [BeamSearchParams(
                beam_width=request.n, max_tokens=m, ignore_eos=request.ignore_eos,
                temperature=request.temperature or 0.0, length_penalty=request.length_penalty,
                include_stop_str_in_output=request.include_stop_str_in_output)
                for m in max_tokens]
        except ValueError as exc:
            raise OpenAIError(str(exc), param=str(exc).split(" ", 1)[0]) from exc
        if request.n * len(prompts) > self.async_llm.max_num_queued_requests:
            raise OpenAIError(f"This request searches {request.n * len(prompts)} beams at once "
                              "(prompts x n), more than the server queues (--max-num-queued-"
                              f"requests={self.async_llm.max_num_queued_requests}).", param="n")
        skip = request.skip_special_tokens
        return [BeamSearchStream(self.async_llm, f"{request_id}-{i}", ids, p, lora_request,
                                 lambda tokens: self.decode_tokens(tokens, skip))
                for i, (ids, p) in enumerate(zip(prompts, params))]

    def decode_tokens(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids ("" without a tokenizer)."""
        tokenizer = self.async_llm.tokenizer
        return tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens) \
            if tokenizer is not None else ""

    def add_requests(self, requests: list[tuple[str, PromptType, SamplingParams]],
                     lora_request: LoRARequest | None = None, priority: int = 0,
                     cache_salt: str | None = None) -> list[RequestStream]:
        """Admits all requests or none (a batch that hits a full queue gets one 429); all use
        `lora_request` (None: the base model) and `cache_salt` (prefix-cache isolation)."""
        num_seqs = sum(params.n for _, _, params in requests)
        limit = self.async_llm.max_num_queued_requests
        if num_seqs > limit:
            raise OpenAIError(f"This request asks for {num_seqs} sequences (prompts x n), more "
                              f"than the server queues at once (--max-num-queued-requests={limit}).",
                              param="n")
        streams: list[RequestStream] = []
        try:
            for request_id, prompt, params in requests:
                if cache_salt is not None:
                    prompt = {**prompt, "cache_salt": cache_salt} if isinstance(prompt, dict) \
                        else TokensPrompt(prompt_token_ids=prompt, cache_salt=cache_salt)
                streams.append(self.async_llm.add_request(request_id, prompt, params,
                                                          lora_request, priority))
        except Exception as exc:
            for stream in streams:
                self.async_llm.abort(stream.request_id)
            raise engine_error(exc) from exc
        return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:
        # NOTE: aclosing, so that a consumer that stops early aborts the request right away
        # instead of whenever the generator is garbage collected.
        async with aclosing(streams[0].outputs()) as outputs:
            async for output in outputs:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async with aclosing(stream.outputs()) as outputs:
                async for output in outputs:
                    await queue.put((i, output))
            await queue.put(done)
        except BaseException as exc:   # noqa: BLE001 - forwarded to the consumer
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_done = 0
        while num_done < len(streams):
            item = await queue.get()
            if item is done:
                num_done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()   # their streams abort the unfinished requests


async def run_until_disconnect(raw_request: Request, work: Awaitable[T]) -> T | None:
    """Runs `work`, cancelling it (which aborts its requests) when the client goes away."""
    work_task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    listener = asyncio.create_task(wait_for_disconnect())
    disconnected = True
    try:
        await asyncio.wait({work_task, listener}, return_when=asyncio.FIRST_COMPLETED)
        disconnected = not work_task.done()
    finally:
        listener.cancel()
        if not work_task.done():
            work_task.cancel()
    return None if disconnected else work_task.result()


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def prompt_logprobs_entries(final: RequestOutput, decode: Any) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` of a request: per prompt position (None first) its token and
    the top-k, each {logprob, rank, decoded_token}."""
    if final.prompt_logprobs is None:
        return None
    return [None if step is None else {
        token_id: PromptLogprob(logprob=clamp_logprob(entry.logprob), rank=entry.rank,
                                decoded_token=entry.decoded_token if entry.decoded_token
                                is not None else decode([token_id]))
        for token_id, entry in step.items()} for step in final.prompt_logprobs]


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int,
               prompt_tokens_details: dict[str, int] | None = None) -> dict[str, Any]:
    """A UsageInfo as the plain dict ChunkEncoder writes."""
    usage: dict[str, Any] = {"prompt_tokens": num_prompt_tokens,
                             "completion_tokens": num_completion_tokens,
                             "total_tokens": num_prompt_tokens + num_completion_tokens}
    if prompt_tokens_details is not None:
        usage["prompt_tokens_details"] = prompt_tokens_details
    return usage


# Compact JSON as pydantic's model_dump_json writes it (UTF-8 text, no spaces).
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class ChunkEncoder:
    """The SSE events of one streamed response, in the shape of its pydantic `*StreamResponse`.

    The fields every chunk repeats (id, object, created, model) are encoded once; each chunk then
    costs one `json.dumps` of its plain-dict choices. NOTE: building and dumping a pydantic model
    per chunk (with the request models' validators) was most of the event loop's time per token.
    """

    def __init__(self, request_id: str, object_name: str, created: int, model: str) -> None:
        head = _dumps({"id": request_id, "object": object_name, "created": created, "model": model})
        self._head = f'data: {head[:-1]},"choices":'

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None,
              extra: dict[str, Any] | None = None) -> str:
        """`extra`: top-level fields of this chunk only (vLLM's prompt_token_ids)."""
        tail = "".join(f',{_dumps(k)}:{_dumps(v)}' for k, v in extra.items()) if extra else ""
        return f'{self._head}{_dumps(choices)},"usage":{_dumps(usage)}{tail}}}\n\n'
