"""Request and response bodies of the OpenAI-compatible API, as pydantic models in OpenAI's shapes."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

from minivllm.entrypoints.openai.tool_parsers import tool_choice_mode, tool_choice_schema
from minivllm.inputs import check_cache_salt
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.utils.unicode_utils import lone_surrogate_path

# Sampling fields a request may leave unset, with vLLM's defaults (a model's generation config
# may give others: OpenAIServing.default_sampling_params).
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                      "repetition_penalty": 1.0}


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    # NOTE: unknown fields are ignored (as vLLM does) so newer clients keep working; NaN and
    # infinity are refused (a NaN temperature would pass every range check).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        # NOTE: JSON's "\ud800" escape decodes to a lone surrogate, which no tokenizer and no
        # UTF-8 response can carry; refusing it here makes it a 400 in every field.
        where = lone_surrogate_path(data)
        if where is not None:
            raise ValueError(f"{where or 'the body'} is not valid Unicode text: it contains a "
                             "lone surrogate (an unpaired \\ud800-\\udfff escape).")
        return data


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: str | None = None
    parent: str | None = None          # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None   # --enable-prompt-tokens-details


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: every chunk carries the usage so far


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str = "response"
    description: str | None = None
    # `schema` would shadow a BaseModel attribute; the JSON key stays "schema".
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat, including vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    # int64, as torch.Generator.manual_seed takes (child i of n gets seed + i).
    seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras (sent with the openai client through `extra_body`).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: dict[str, Any] | None = None   # vLLM's StructuredOutputsParams fields
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None   # the prompt's last k tokens (-1: max_model_len)
    prompt_logprobs: int | None = Field(default=None, ge=0)   # not streamed
    use_beam_search: bool = False   # n = the beam width (engine/beam_search_stream.py)
    # vLLM's: the prompt's and each choice's token ids beside the text (streamed: the prompt's
    # with a choice's first chunk, then each chunk's new ids)
    return_token_ids: bool = False
    priority: int = Field(default=0, ge=-2**63, le=2**63 - 1)   # --scheduling-policy priority
    length_penalty: float = 1.0
    # vLLM's: only requests with the same salt share prefix-cache blocks (inputs.py)
    cache_salt: str | None = None
    # vLLM's: logprobs name tokens "token_id:<id>" (None: the server's
    # --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = None   # vLLM's: the response id's suffix (X-Request-Id wins)
    # vLLM's: settings for the server's custom logits processors (SamplingParams.extra_args)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, salt: str | None) -> str | None:
        return check_cache_salt(salt)

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Raises ValueError (from SamplingParams) naming the bad field. `defaults`: the model's
        generation-config values for the sampling fields the request leaves unset."""
        if self.prompt_logprobs is not None:
            if self.stream:
                raise ValueError("prompt_logprobs is not available when stream is true.")
            if prompt_logprobs is not None:
                raise ValueError("prompt_logprobs cannot be combined with echo and logprobs, "
                                 "which return the prompt's logprobs already.")
            prompt_logprobs = self.prompt_logprobs
        unset = {**_SAMPLING_DEFAULTS, **(defaults or {})}
        given = {k: getattr(self, k) for k in _SAMPLING_DEFAULTS}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            **{k: unset[k] if v is None else v for k, v in given.items()},
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=self._structured_outputs(),
            truncate_prompt_tokens=self.truncate_prompt_tokens, extra_args=self.vllm_xargs or None)

    def _logit_bias(self) -> dict[int, float] | None:
        bias = self.logit_bias or {}
        try:   # OpenAI's range; vLLM clamps to it the same way.
            return {int(t): min(100.0, max(-100.0, b)) for t, b in bias.items()} or None
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as strings).") from None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """From `response_format` (OpenAI) or `structured_outputs` (vLLM); not both."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs:
            raise ValueError("structured_outputs cannot be combined with response_format.")
        if self.structured_outputs:
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs has an unknown field: {exc}") from None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ValueError("response_format json_schema needs `json_schema.schema`.")
        # OpenAI's strict mode: objects take no properties the schema does not list.
        return StructuredOutputsParams(json=fmt.json_schema.json_schema,
                                       disable_additional_properties=bool(fmt.json_schema.strict))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


# ---------------------------------------------------------------- /v1/completions

class CompletionRequest(_SamplingRequest):
    # vLLM's (--enable-prompt-embeds): prompts as base64 of torch.save'd [num_tokens, H] tensors
    prompt_embeds: str | list[str] | None = None
    # (after prompt_embeds: its check reads that field)
    prompt: str | list[str] | list[int] | list[list[int]] | None = Field(default=None,
                                                                         validate_default=True)
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True   # vLLM's: text prompts get the tokenizer's BOS etc.

    @field_validator("prompt")
    @classmethod
    def _needs_a_prompt(cls, prompt: Any, info: ValidationInfo) -> Any:
        if prompt is None and not info.data.get("prompt_embeds"):
            raise ValueError("Give `prompt` or `prompt_embeds`.")
        return prompt

    def to_sampling_params(self, max_tokens: int,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        if self.suffix:
            raise ValueError("suffix is not supported.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}); best_of > n is not supported.")
        # With echo, the returned logprobs cover the prompt too.
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's `prompt_logprobs` entry (per prompt position: token id -> this; None first)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None   # return_token_ids
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- /v1/chat/completions

class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False   # the last (assistant) message is continued
    chat_template_kwargs: dict[str, Any] | None = None   # extra template variables
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the reply starts with the last message's content when that message has the
    # reply's role (continue_final_message)
    echo: bool = False
    # vLLM's: the tokenizer's special tokens on top of the template's (it adds BOS itself)
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None   # for RAG chat templates

    @property
    def tool_mode(self) -> str | None:
        """None (no tool parsing), "auto", "required" or "named"; raises ValueError if bad."""
        return tool_choice_mode(self.tools, self.tool_choice)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """`required` and a named tool_choice are enforced by a JSON schema, so the output
        always parses: a list of {name, parameters} calls, or the named tool's arguments."""
        schema = tool_choice_schema(self.tools, self.tool_choice, self.parallel_tool_calls)
        if schema is None:
            return super()._structured_outputs()
        if self.structured_outputs or (self.response_format and self.response_format.type != "text"):
            raise ValueError(f"tool_choice {self.tool_mode!r} cannot be combined with "
                             "response_format or structured_outputs.")
        return StructuredOutputsParams(json=schema)

    def to_sampling_params(self, max_tokens: int,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true.")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults=defaults)

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens is OpenAI's current name; max_tokens the deprecated one."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
