"""What the offline API takes as a prompt (vLLM's `vllm.inputs`): text, token ids, or a
`TextPrompt` / `TokensPrompt` dict; `prompt_input` reduces any of them to text or token ids."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

if TYPE_CHECKING:
    import torch


class TextPrompt(TypedDict):
    prompt: str
    # Salts the prefix cache: only requests with the same salt share cached KV blocks.
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


class EmbedsPrompt(TypedDict):
    """The prompt as input embeddings [num_tokens, hidden_size], in place of token ids (the
    engine needs enable_prompt_embeds=True)."""
    prompt_embeds: torch.Tensor
    cache_salt: NotRequired[str]


# text, token ids, or a dict with 'prompt' / 'prompt_token_ids' / 'prompt_embeds'
PromptType = str | list[int] | TextPrompt | TokensPrompt | EmbedsPrompt | dict[str, Any]


def prompt_input(prompt: PromptType) -> str | list[int]:
    """A prompt as vLLM takes it (text, token ids, or a TextPrompt / TokensPrompt dict) as
    text or token ids."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not is_token_ids(ids):
                raise ValueError("A prompt dict's 'prompt_token_ids' must be a list of token ids "
                                 f"(ints), got {type(ids).__name__}.")
            return [int(t) for t in ids]
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError("A prompt dict's 'prompt' must be a string, got "
                                 f"{type(prompt['prompt']).__name__}.")
            return prompt["prompt"]
        raise ValueError("A prompt dict needs 'prompt', 'prompt_token_ids' or 'prompt_embeds'")
    if isinstance(prompt, str):
        return prompt
    if is_token_ids(prompt):
        return [int(t) for t in prompt]
    raise ValueError(f"Unsupported prompt type {type(prompt).__name__}: give a string, a list of "
                     "token ids, or a dict with 'prompt' / 'prompt_token_ids'")


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's `cache_salt` (None when it has none); ValueError unless a non-empty
    string. A salted request reuses only KV blocks cached under the same salt, so tenants of
    one server cannot probe each other's prompts through prefix-cache timing."""
    if not isinstance(prompt, dict):
        return None
    return check_cache_salt(prompt.get("cache_salt"))


def check_cache_salt(salt: Any) -> str | None:
    """`salt` if None or a non-empty string; ValueError otherwise (vLLM's message)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    return salt


def is_token_ids(ids: Any) -> bool:
    """A list or tuple of ints (numpy / torch integer scalars count; bools do not)."""
    return isinstance(ids, (list, tuple)) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids)


def check_truncate_prompt_tokens(k: int | None) -> None:
    """ValueError unless `truncate_prompt_tokens` is None, -1 or at least 1."""
    if k is not None and k != -1 and k < 1:
        raise ValueError("truncate_prompt_tokens must be -1 (the last max_model_len tokens) or "
                         f"at least 1, got {k}.")


def truncate_prompt(prompt_token_ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """vLLM's left truncation (`truncate_prompt_tokens`): the last k tokens; -1: the last
    max_model_len; None: all. ValueError for any other k."""
    check_truncate_prompt_tokens(k)
    if k is None:
        return prompt_token_ids
    return prompt_token_ids[-(max_model_len if k == -1 else k):]


def check_prompt_token_ids(token_ids: list[int], vocab_size: int | None,
                           max_model_len: int | None = None) -> None:
    """ValueError for an empty prompt, an id outside the vocabulary (naming it) or one longer
    than max_model_len; the engine and the server check prompts with it."""
    if not token_ids:
        raise ValueError("The prompt is empty; give at least one token.")
    limit = vocab_size if vocab_size is not None else float("inf")
    bad = next((t for t in token_ids if not 0 <= t < limit), None)
    if bad is not None:
        raise ValueError(f"Token id {bad} is out of range: ids must be in [0, {vocab_size}).")
    if max_model_len is not None and len(token_ids) > max_model_len:
        raise ValueError(f"The prompt has {len(token_ids)} tokens, more than "
                         f"max_model_len={max_model_len}.")
