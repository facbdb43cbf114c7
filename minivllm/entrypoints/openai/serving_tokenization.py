"""/tokenize and /detokenize (vLLM's `serving_tokenization`): their bodies and
`OpenAIServingTokenization`, which the routes in api_server.py call."""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.openai.protocol import OpenAIBaseModel
from minivllm.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing
from minivllm.entrypoints.openai.tool_parsers import check_tools


class TokenizeRequest(OpenAIBaseModel):
    """Either `prompt` (raw text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    # vLLM's defaults: True for a prompt, False for messages (the template adds its own)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None   # rendered as chat completions render them
    documents: list[dict[str, str]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class OpenAIServingTokenization(OpenAIServing):
    """Text or a chat (through the chat template) to token ids, and back."""

    def tokenize(self, request: TokenizeRequest) -> dict[str, Any]:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give exactly one of `prompt` and `messages`.", param="prompt")
        if request.messages is not None:
            try:
                check_tools(request.tools)
            except ValueError as exc:
                raise OpenAIError(str(exc), param="tools") from exc
            ids = self.render_chat(request.messages, request.chat_template, tools=request.tools,
                                   add_generation_prompt=request.add_generation_prompt,
                                   continue_final_message=request.continue_final_message,
                                   chat_template_kwargs=request.chat_template_kwargs,
                                   documents=request.documents,
                                   add_special_tokens=bool(request.add_special_tokens))
        else:
            special = request.add_special_tokens is not False
            ids = list(self.tokenizer.encode(request.prompt, add_special_tokens=special))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=strs).model_dump(exclude_none=True)

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(request.model)
        if request.tokens:
            self.check_token_ids(request.tokens, param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens)).model_dump()
