"""LLMEngine's sleep mode (vLLM's `sleep` / `wake_up` / `is_sleeping`, with
`enable_sleep_mode=True`): every rank frees its KV cache (level 1) or its weights too (level 2;
worker/sleep_mode.py) while the engine idles; requests are refused until it wakes up."""

from __future__ import annotations

from typing import Any

from minivllm.worker.sleep_mode import SLEEP_TAGS

SLEEP_LEVELS = (1, 2)


class SleepMixin:
    """Needs `vllm_config`, `executor`, `scheduler`, `collective_rpc`, `reset_prefix_cache`,
    `get_num_unfinished_requests` and `_lora_requests` (re-added after level 2)."""

    vllm_config: Any
    executor: Any
    _lora_requests: dict
    # Tags the ranks have let go of (a subset of SLEEP_TAGS) and the level that did it.
    _asleep: frozenset[str] = frozenset()
    _sleep_level: int = 0

    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache, level 2 the weights too (reloaded at `wake_up`). The
        prefix cache is forgotten; ValueError while requests are unfinished."""
        if not self.vllm_config.model_config.enable_sleep_mode:
            raise ValueError("Sleep mode is not enabled; create the engine with "
                             "enable_sleep_mode=True (--enable-sleep-mode)")
        if level not in SLEEP_LEVELS or isinstance(level, bool):
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        if self.get_num_unfinished_requests():
            raise ValueError(f"cannot sleep with {self.get_num_unfinished_requests()} "
                             "unfinished request(s); let them finish (or abort them) first")
        if self._asleep:
            raise ValueError(f"the engine is already asleep (level {self._sleep_level}); call "
                             "wake_up() first")
        self.reset_prefix_cache()          # the cached blocks' contents are about to go
        self.collective_rpc("sleep", args=(level,))
        self._asleep = frozenset(SLEEP_TAGS if level == 2 else ("kv_cache",))
        self._sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Takes back the weights and / or the KV cache (`tags`, from "weights" and
        "kv_cache"; None: both). Adapters added before a level-2 sleep are loaded again."""
        if tags is not None:
            tags = [tags] if isinstance(tags, str) else list(tags)
            bad = [t for t in tags if t not in SLEEP_TAGS]
            if bad or not tags:
                raise ValueError(f"wake_up tags must be among {list(SLEEP_TAGS)}, got {tags!r}")
        if not self._asleep:
            return
        self.collective_rpc("wake_up", args=(tags,))
        woken = set(SLEEP_TAGS if tags is None else tags)
        if "weights" in woken and "weights" in self._asleep:
            for lora_request in self._lora_requests.values():
                self.executor.add_lora(lora_request)
        self._asleep = frozenset(self._asleep - woken)
        if not self._asleep:
            self._sleep_level = 0

    def is_sleeping(self) -> bool:
        """True while some rank holds neither its KV cache or its weights."""
        return bool(self._asleep)

    def check_awake(self) -> None:
        """ValueError for a request while asleep (it could not run)."""
        if self._asleep:
            raise ValueError(f"The engine is asleep (sleep level {self._sleep_level}: "
                             f"{', '.join(sorted(self._asleep))} released); call wake_up() "
                             "(POST /wake_up) before sending requests")
