"""From a prompt as the user gives it to what a request runs (vLLM's input processing): text
tokenised, a prompt dict's extras (`cache_salt`, `prompt_embeds`), left truncation, and the
length / vocabulary checks, each failure a ValueError naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minivllm.inputs import (PromptType, check_prompt_token_ids, check_truncate_prompt_tokens,
                             prompt_cache_salt, prompt_input, truncate_prompt)


@dataclass
class ProcessedPrompt:
    text: str | None
    # An embeds prompt has no tokens: zeros stand in, one per position, so that the scheduler's
    # lengths and block counts hold; the model reads `embeds` at those positions.
    token_ids: list[int]
    embeds: torch.Tensor | None = None   # [L, H] on the CPU, the caller's float dtype
    cache_salt: str | None = None


class InputProcessor:
    """Checks prompts against the model (vocabulary, max_model_len, hidden size)."""

    def __init__(self, vllm_config: Any, tokenizer: Any | None, vocab_size: int | None) -> None:
        model = vllm_config.model_config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len: int = model.max_model_len
        self.enable_prompt_embeds = bool(getattr(model, "enable_prompt_embeds", False))
        text_config = getattr(model, "hf_text_config", None)
        self.hidden_size: int | None = getattr(text_config, "hidden_size", None)
        self.speculating = getattr(vllm_config, "speculative_config", None) is not None

    def process(self, prompt: PromptType, params: Any) -> ProcessedPrompt:
        """`params`: the request's SamplingParams or PoolingParams (truncation, logprobs)."""
        salt = prompt_cache_salt(prompt)
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            embeds = self._check_embeds(prompt["prompt_embeds"], params)
            return ProcessedPrompt(None, [0] * len(embeds), embeds, salt)
        text, token_ids = self.tokenize(prompt)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        check_prompt_token_ids(token_ids, self.vocab_size, self.max_model_len)
        return ProcessedPrompt(text, token_ids, None, salt)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a text or token prompt (text tokenised)."""
        prompt = prompt_input(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("A text prompt needs a tokenizer; pass token ids instead.")
            return prompt, list(self.tokenizer.encode(prompt))
        return None, list(prompt)

    def _check_embeds(self, embeds: Any, params: Any) -> torch.Tensor:
        """vLLM's EmbedsPrompt: a float tensor [L, hidden_size] ([1, L, H] is squeezed)."""
        if not self.enable_prompt_embeds:
            raise ValueError("You must set `--enable-prompt-embeds` (enable_prompt_embeds=True) "
                             "to input `prompt_embeds`.")
        if self.speculating:
            raise ValueError("prompt_embeds cannot be used with speculative decoding.")
        if getattr(params, "prompt_logprobs", None) is not None:
            raise ValueError("prompt_logprobs is not available for a prompt given as "
                             "prompt_embeds (its tokens are unknown).")
        if not isinstance(embeds, torch.Tensor) or not embeds.is_floating_point():
            raise ValueError("prompt_embeds must be a floating-point torch.Tensor of shape "
                             f"(num_tokens, {self.hidden_size}), got {type(embeds).__name__}.")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        if embeds.dim() != 2 or embeds.shape[1] != self.hidden_size or embeds.shape[0] == 0:
            raise ValueError(f"prompt_embeds must have shape (num_tokens, {self.hidden_size}) "
                             f"(the model's hidden size), got {tuple(embeds.shape)}.")
        k = params.truncate_prompt_tokens
        check_truncate_prompt_tokens(k)
        if k is not None:
            embeds = embeds[-(self.max_model_len if k == -1 else k):]
        if len(embeds) > self.max_model_len:
            raise ValueError(f"The prompt has {len(embeds)} tokens, more than "
                             f"max_model_len={self.max_model_len}.")
        return embeds.detach().to("cpu").contiguous()
