"""vLLM's `LoggingStatLogger`: the server's periodic log line ("Avg prompt throughput: ...
tokens/s, Avg generation throughput: ..., Running: N reqs, Waiting: M reqs, KV cache usage:
...%"), every VLLM_LOG_STATS_INTERVAL seconds while requests come and go; `--disable-log-stats`
turns it off. It is one of AsyncLLM's stat loggers, called from the engine loop thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from minivllm.logger import init_logger

logger = init_logger(__name__)


class LoggingStatLogger:
    """Counts prompt and generated tokens between two log lines; `snapshot()` gives the
    engine's gauges (running, waiting, KV usage) when a line is written."""

    def __init__(self, snapshot: Callable[[], Any], interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.snapshot = snapshot
        self.interval_s = interval_s
        self.clock = clock
        self.last_log_s = clock()
        self.prompt_tokens = self.generation_tokens = 0
        self.lines: list[str] = []       # the last few lines written (kept for inspection)

    # StatLogger interface
    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens += num_prompt_tokens
        self._maybe_log()

    def on_new_tokens(self, num_new_tokens: int, ttft_s: float | None,
                      itl_s: float | None) -> None:
        self.generation_tokens += num_new_tokens
        self._maybe_log()

    def on_request_finished(self, finish_reason: str, e2e_s: float) -> None:
        self._maybe_log()

    def _maybe_log(self) -> None:
        now = self.clock()
        elapsed = now - self.last_log_s
        if elapsed < self.interval_s:
            return
        stats = self.snapshot()
        line = (f"Avg prompt throughput: {self.prompt_tokens / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%")
        logger.info(line)
        self.lines = [*self.lines[-9:], line]
        self.last_log_s, self.prompt_tokens, self.generation_tokens = now, 0, 0
