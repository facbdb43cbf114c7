"""vLLM's `RequestLogger` (`--enable-log-requests`): one INFO line per request the server
receives, its prompt cut to `--max-log-len` characters (or token ids), and its parameters."""

from __future__ import annotations

from typing import Any

from minivllm.logger import init_logger

logger = init_logger(__name__)


class RequestLogger:
    def __init__(self, *, max_log_len: int | None = None) -> None:
        if max_log_len is not None and max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {max_log_len}")
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: Any, params: Any,
                   lora_request: Any = None) -> str:
        """Logs (and returns) the line for one request: a text prompt, token ids, or a dict
        prompt (its text or ids)."""
        text, ids = _prompt_parts(prompt)
        if self.max_log_len is not None:
            text = None if text is None else text[:self.max_log_len]
            ids = None if ids is None else ids[:self.max_log_len]
        line = (f"Received request {request_id}: prompt: {text!r}, params: {params}, "
                f"prompt_token_ids: {ids}, lora_request: {lora_request}")
        logger.info(line)
        return line


def _prompt_parts(prompt: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return prompt.get("prompt"), None if ids is None else list(ids)
    return None, list(prompt)
