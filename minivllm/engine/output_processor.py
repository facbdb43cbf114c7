"""The engine's per-request output state: new tokens -> logprobs, text and stop strings.

vLLM keeps this in `v1/engine/output_processor.py`; here the engine calls `process_child` for
each sequence a step advanced, and `LLMEngine` turns the states into `RequestOutput`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.request import Request, RequestStatus
from minivllm.outputs import Logprob
from minivllm.v1.outputs import LogprobEntry


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    pooling_params: Any = None   # a pooling request: PoolingParams, then the runner's vector
    pooled: Any = None
    cache_salt: str | None = None   # the prompt's (every child's blocks are keyed by it)
    prompt_embeds: Any = None       # [L, H] for an embeds prompt; its token ids are stand-ins

    @property
    def known_prompt_token_ids(self) -> list[int]:
        """The prompt's real token ids: none for an embeds prompt."""
        return [] if self.prompt_embeds is not None else self.prompt_token_ids


@dataclass
class ChildState:
    request: Request
    parent: ParentState
    index: int
    detokenizer: IncrementalDetokenizer | None
    num_processed_tokens: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


def process_child(child: ChildState, token_logprobs: list[list[LogprobEntry]] | None,
                  tokenizer: Any) -> str | None:
    """Takes the tokens the step appended to the child's request (`token_logprobs`: one entry
    list per token where logprobs were asked); returns the stop string they completed, if any.

    A step with draft tokens appends several tokens; when a stop string ends inside them, the
    tokens after it are dropped, so the output is that of decoding one token at a time.
    """
    request = child.request
    new_token_ids = request.output_token_ids[child.num_processed_tokens:]
    stop_string = None
    if child.detokenizer is not None:
        params = request.sampling_params
        text_ids = new_token_ids
        if (request.status == RequestStatus.FINISHED_STOPPED and text_ids
                and not params.include_stop_str_in_output
                and text_ids[-1] in params.all_stop_token_ids):
            text_ids = text_ids[:-1]   # the eos / stop token stays out of the text
        if len(text_ids) > 1 and params.stop:
            for used, token_id in enumerate(text_ids, 1):
                stop_string = child.detokenizer.update([token_id])
                if stop_string is not None:
                    request.drop_last_output_tokens(len(new_token_ids) - used)
                    new_token_ids = new_token_ids[:used]
                    break
        else:
            stop_string = child.detokenizer.update(text_ids)
    child.num_processed_tokens = request.num_output_tokens
    if child.logprobs is not None and token_logprobs is not None:
        for entries in token_logprobs[:len(new_token_ids)]:
            child.logprobs.append(to_logprob_dict(entries, tokenizer))
            child.cumulative_logprob += entries[0][1]
    return stop_string


def to_logprob_dict(entries: list[LogprobEntry], tokenizer: Any) -> dict[int, Logprob]:
    return {token_id: Logprob(logprob, rank, decode_token(token_id, tokenizer))
            for token_id, logprob, rank in entries}


def decode_token(token_id: int, tokenizer: Any) -> str | None:
    if tokenizer is None:
        return None
    token = tokenizer.convert_ids_to_tokens(token_id)
    return tokenizer.convert_tokens_to_string([token]) if token is not None else None
