"""POST /v1/chat/completions: messages through the chat template, n choices, JSON or SSE."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.engine.async_llm import RequestStream
from minivllm.entrypoints.openai.chat_protocol import (ChatCompletionLogProb,
                                                       ChatCompletionLogProbs,
                                                       ChatCompletionLogProbsContent,
                                                       ChatCompletionResponse,
                                                       ChatCompletionResponseChoice, ChatMessage,
                                                       DeltaFunctionCall, DeltaToolCall,
                                                       FunctionCall, ToolCall)
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, UsageInfo
from minivllm.entrypoints.openai.serving_engine import (ChunkEncoder, OpenAIError, OpenAIServing,
                                                        clamp_logprob, engine_error, merge_streams,
                                                        prompt_logprobs_entries,
                                                        run_until_disconnect, sse_error, usage_dict)
from minivllm.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser, check_tools
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.transformers_utils.chat_template import normalize_messages


@dataclass
class ChoiceState:
    in_reasoning: bool = False  # the prompt left the model inside its reasoning
    num_reasoning_chars: int = 0
    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False
    num_calls: int = 0          # tool calls sent
    num_ids_sent: int = 0       # return_token_ids
    tool_call_id: str = ""      # of the named tool's streamed call


class OpenAIServingChat(OpenAIServing):

    def __init__(self, *args, tool_parser: ToolParser | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser   # set by --enable-auto-tool-choice --tool-call-parser
        self.response_role = "assistant"   # --response-role: the reply's role
        self.reasoning_parser = getattr(self.async_llm, "reasoning_parser", None)

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        lora_request = self.check_model(request.model)
        mode = self.tool_mode(request)
        prompt_ids = self.render_chat(
            request.messages, request.chat_template, tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs, documents=request.documents,
            add_special_tokens=request.add_special_tokens)
        prompt_ids = self.truncate_prompt(prompt_ids, request)
        self.check_token_ids(prompt_ids, param="messages")
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.resolve_max_tokens(len(prompt_ids), request.requested_max_tokens, param)
        request_id = f"chatcmpl-{self.base_request_id(raw_request, request)}"
        if request.use_beam_search:
            [stream] = self.beam_search_streams(request, [prompt_ids], [max_tokens], request_id,
                                                lora_request)
        else:
            params = self.sampling_params(request, max_tokens, {"max_tokens": param})
            [stream] = self.add_requests([(request_id, prompt_ids, params)], lora_request,
                                         request.priority, request.cache_salt)
        created = int(time.time())
        in_reasoning = self.starts_in_reasoning(prompt_ids)
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, created, prompt_ids,
                                                  in_reasoning, stream),
                                     media_type="text/event-stream")
        final = await self.final_output(raw_request, stream)
        if final is None:
            return Response(status_code=499)   # the client is gone; nobody reads this
        choices = []
        role = chat_request_role(request, self.response_role)
        echo = echo_text(request, role)
        for out in final.outputs:
            reasoning, text = self.split_reasoning(out.text, True, in_reasoning)
            content, calls = self._split_tool_calls(request, mode, text)
            content = echo + (content or "") if echo else content
            tool_calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments))
                          for c in calls]
            choices.append(ChatCompletionResponseChoice(
                index=out.index, message=ChatMessage(role=role, content=content,
                                                     reasoning=reasoning or None,
                                                     tool_calls=tool_calls or None),
                token_ids=list(out.token_ids) if request.return_token_ids else None,
                logprobs=self.chat_logprobs(request, out, 0),
                finish_reason=self._finish_reason(mode, out.finish_reason, bool(calls)),
                stop_reason=out.stop_reason))
        num_completion = sum(len(out.token_ids) for out in final.outputs)
        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=num_completion,
                          total_tokens=len(prompt_ids) + num_completion,
                          prompt_tokens_details=self.prompt_tokens_details(
                              final.num_cached_tokens))
        prompt_logprobs = None if request.prompt_logprobs is None else \
            prompt_logprobs_entries(final, self.decode_tokens)
        response = ChatCompletionResponse(id=request_id, created=created,
                                          model=self.model_name(request.model), choices=choices,
                                          usage=usage, prompt_logprobs=prompt_logprobs,
                                          prompt_token_ids=prompt_ids
                                          if request.return_token_ids else None)
        return JSONResponse(response.model_dump(mode="json"))

    async def final_output(self, raw_request: Request, stream: RequestStream
                           ) -> RequestOutput | None:
        """The request's last output; None when the client left first (the request is then
        aborted). Engine errors become their HTTP errors."""
        try:
            return await run_until_disconnect(raw_request, self._collect(stream))
        except Exception as exc:
            raise engine_error(exc) from exc

    @staticmethod
    async def _collect(stream: RequestStream):
        final = None
        async with aclosing(merge_streams([stream])) as merged:
            async for _, output in merged:
                final = output
        return final

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int,
                      prompt_ids: list[int], in_reasoning: bool, stream: RequestStream
                      ) -> AsyncIterator[str]:
        num_prompt_tokens = len(prompt_ids)
        states = [ChoiceState(in_reasoning) for _ in range(request.n)]
        encoder = ChunkEncoder(request_id, "chat.completion.chunk", created,
                               self.model_name(request.model))
        final = None

        def usage() -> dict[str, int]:   # the request's so far, all choices
            if final is None:
                return usage_dict(num_prompt_tokens, 0, self.prompt_tokens_details(0))
            return usage_dict(num_prompt_tokens, sum(len(out.token_ids) for out in final.outputs),
                              self.prompt_tokens_details(final.num_cached_tokens))
        try:
            # The role comes first, in a chunk of its own per choice (as OpenAI does).
            role = chat_request_role(request, self.response_role)
            yield encoder.chunk([_stream_choice(i, {"role": role, "content": ""})
                                 for i in range(request.n)],
                                usage() if request.continuous_usage else None,
                                {"prompt_token_ids": prompt_ids} if request.return_token_ids
                                else None)
            if echo := echo_text(request, role):   # then the echoed message (vLLM's order)
                yield encoder.chunk([_stream_choice(i, {"content": echo})
                                     for i in range(request.n)])
            mode = self.tool_mode(request)
            async with aclosing(merge_streams([stream])) as merged:
                async for _, final in merged:
                    choices = [c for out in final.outputs
                               if (c := self._stream_choice(request, mode, out, states[out.index]))]
                    if choices:
                        yield encoder.chunk(choices, usage() if request.continuous_usage else None)
            if request.include_usage and final is not None:
                yield encoder.chunk([], usage())
        except Exception as exc:   # noqa: BLE001 - the status line is sent; report in-band
            yield sse_error(exc)
        yield "data: [DONE]\n\n"

    def _stream_choice(self, request: ChatCompletionRequest, mode: str | None,
                       out: CompletionOutput, state: ChoiceState) -> dict[str, Any] | None:
        """The new part of one choice (a ChatCompletionStreamChoice as a dict), or None."""
        if state.finished:
            return None
        finished = out.finish_reason is not None
        reasoning, delta, tool_calls = self.stream_delta(request, mode, out.text, finished, state)
        logprobs = self.chat_logprobs(request, out, state.num_tokens)
        state.num_tokens = len(out.token_ids)
        state.finished = finished
        if logprobs is not None and not logprobs.content:
            logprobs = None
        if not (reasoning or delta or tool_calls or state.finished) and logprobs is None:
            return None
        called = state.num_calls > 0 or bool(state.tool_call_id)
        # OpenAI's deltas carry only the fields they set.
        delta_fields: dict[str, Any] = {"reasoning": reasoning} if reasoning else {}
        if delta:
            delta_fields["content"] = delta
        if tool_calls:
            delta_fields["tool_calls"] = [c.model_dump(mode="json") for c in tool_calls]
        choice = _stream_choice(out.index, delta_fields, logprobs,
                                self._finish_reason(mode, out.finish_reason, called),
                                out.stop_reason)
        if request.return_token_ids:
            choice["token_ids"] = list(out.token_ids[state.num_ids_sent:])
            state.num_ids_sent = len(out.token_ids)
        return choice

    def sampling_params(self, request: Any, max_tokens: int,
                        aliases: dict[str, str] | None = None) -> SamplingParams:
        params = super().sampling_params(request, max_tokens, aliases)
        if self.tool_parser is not None and not self.tool_parser.skip_special_tokens and \
                request.tools and request.tool_mode == "auto":
            params.skip_special_tokens = False   # the parser reads the model's call token
        return params

    def starts_in_reasoning(self, prompt_ids: list[int]) -> bool:
        return self.reasoning_parser is not None and \
            self.reasoning_parser.starts_in_reasoning(prompt_ids)

    def split_reasoning(self, text: str, final: bool, in_reasoning: bool) -> tuple[str, str]:
        """(reasoning, content) of a choice's text ("" and the text without a reasoning
        parser)."""
        if self.reasoning_parser is None:
            return "", text
        return self.reasoning_parser.parse(text, final, in_reasoning)

    def stream_delta(self, request: ChatCompletionRequest, mode: str | None, text: str,
                     finished: bool, state: ChoiceState
                     ) -> tuple[str, str, list[DeltaToolCall]]:
        """The new reasoning, the new content and the new tool calls (whole, or the named
        tool's argument fragment) since the last chunk."""
        reasoning, text = self.split_reasoning(text, finished, state.in_reasoning)
        new_reasoning = reasoning[state.num_reasoning_chars:]
        state.num_reasoning_chars = max(state.num_reasoning_chars, len(reasoning))
        content, calls = self._content_delta(request, mode, text, finished, state)
        return new_reasoning, content, calls

    def _content_delta(self, request: ChatCompletionRequest, mode: str | None, text: str,
                       finished: bool, state: ChoiceState) -> tuple[str, list[DeltaToolCall]]:
        if mode == "named":
            fragment = text[state.num_chars:]
            state.num_chars = len(text)
            if not fragment:
                return "", []
            first = not state.tool_call_id
            state.tool_call_id = state.tool_call_id or ToolCall(
                function=FunctionCall(name="", arguments="")).id
            name = request.tool_choice["function"]["name"] if first else None
            return "", [DeltaToolCall(index=0, id=state.tool_call_id if first else None,
                                      type="function" if first else None,
                                      function=DeltaFunctionCall(name=name, arguments=fragment))]
        if mode is None:
            content, calls = text, []
        elif mode == "required" and not finished:
            content, calls = "", []   # the JSON list is parsed once complete
        else:
            content, calls = self._split_tool_calls(request, mode, text, final=finished)
            content = content or ""
        delta = content[state.num_chars:]
        state.num_chars = max(state.num_chars, len(content))
        new_calls = [DeltaToolCall(index=state.num_calls + i, **_whole_call(c))
                     for i, c in enumerate(calls[state.num_calls:])]
        state.num_calls = len(calls)
        return delta, new_calls

    def tool_mode(self, request: ChatCompletionRequest) -> str | None:
        try:
            check_tools(request.tools)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="tools") from exc
        try:
            mode = request.tool_mode
        except ValueError as exc:
            raise OpenAIError(str(exc), param="tool_choice") from exc
        if mode == "auto" and self.tool_parser is None:
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set.", HTTPStatus.BAD_REQUEST, "tool_choice")
        return mode

    def _split_tool_calls(self, request: ChatCompletionRequest, mode: str | None, text: str,
                          final: bool = True) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, tool calls) of a choice's text under the request's tool_choice."""
        if mode == "auto":
            content, calls = self.tool_parser.parse(text, final, tools=request.tools)
            return (content if content.strip() or not calls else None), calls
        if mode == "named":
            return None, [ParsedToolCall(request.tool_choice["function"]["name"], text)]
        if mode == "required":
            try:   # the grammar made it a JSON list of {name, parameters}
                items = json.loads(text)
                return None, [ParsedToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False))
                              for i in items]
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []   # cut short by max_tokens: no call to report
        return text, []

    @staticmethod
    def _finish_reason(mode: str | None, finish_reason: str | None, called: bool) -> str | None:
        # OpenAI reports "tool_calls" when the model chose to call; a forced (named) call is "stop".
        if finish_reason == "stop" and called and mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def chat_logprobs(self, request: ChatCompletionRequest, out: CompletionOutput,
                      start: int) -> ChatCompletionLogProbs | None:
        """Chat schema: per token, its logprob and bytes, then the top_logprobs by rank."""
        if not request.logprobs:
            return None
        num_top = request.top_logprobs or 0
        as_ids = self.tokens_as_ids(request)
        content = []
        for token_id, step in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
            entry = step.get(token_id)
            if entry is None:
                continue
            top = sorted(((tid, lp) for tid, lp in step.items()
                          if lp.rank is not None and lp.rank <= num_top), key=lambda x: x[1].rank)
            content.append(ChatCompletionLogProbsContent(
                **self._logprob(token_id, entry, as_ids).model_dump(),
                top_logprobs=[self._logprob(tid, lp, as_ids) for tid, lp in top][:num_top]))
        return ChatCompletionLogProbs(content=content)

    @staticmethod
    def _logprob(token_id: int, lp: Logprob, as_ids: bool) -> ChatCompletionLogProb:
        token = lp.decoded_token
        if token is None or as_ids:   # JSON cannot carry every token's bytes as text
            token = f"token_id:{token_id}"
        return ChatCompletionLogProb(token=token, logprob=clamp_logprob(lp.logprob),
                                     bytes=list(token.encode("utf-8", errors="replace")))


def chat_request_role(request: ChatCompletionRequest, response_role: str = "assistant") -> str:
    """vLLM's: the reply is `response_role`'s (--response-role) after a generation prompt,
    else it continues the last message in that message's role."""
    return response_role if request.add_generation_prompt else request.messages[-1]["role"]


def echo_text(request: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat `echo`: the last message's text when it has the reply's role, else ""."""
    if not request.echo:
        return ""
    last = normalize_messages(request.messages[-1:])[0]
    return (last.get("content") or "") if last["role"] == role else ""


def _stream_choice(index: int, delta: dict[str, Any], logprobs: ChatCompletionLogProbs | None = None,
                   finish_reason: str | None = None,
                   stop_reason: int | str | None = None) -> dict[str, Any]:
    """A ChatCompletionStreamChoice as the plain dict ChunkEncoder writes."""
    return {"index": index, "delta": delta,
            "logprobs": logprobs.model_dump(mode="json") if logprobs is not None else None,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def _whole_call(call: ParsedToolCall) -> dict:
    return {"id": ToolCall(function=FunctionCall(name=call.name, arguments="")).id,
            "type": "function",
            "function": DeltaFunctionCall(name=call.name, arguments=call.arguments)}
