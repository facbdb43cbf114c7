"""A request inside the engine: plain counters over its prompt and generated tokens."""

from __future__ import annotations

import enum
import time
from typing import Any

from minivllm.lora.request import LoRARequest
from minivllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated (a child of an n > 1 request is its own Request)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        prompt_embeds: Any = None,
    ) -> None:
        self.request_id = request_id
        self.cache_salt = cache_salt   # keys its prefix-cache blocks (inputs.prompt_cache_salt)
        # [L, H] when the prompt came as embeddings (its token ids are then stand-in zeros)
        self.prompt_embeds = prompt_embeds
        self.priority = priority   # lower is served first (--scheduling-policy priority)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None   # stop token id or stop string
        self.output_token_ids: list[int] = []
        # NOTE: prompt + output tokens, kept as one list so slicing the next chunk is cheap.
        self._all_token_ids: list[int] = list(prompt_token_ids)
        # Tokens whose KV is in the cache (or scheduled to be written this step).
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission; -1 = not admitted yet.
        self.num_cached_tokens = -1
        # Chained hashes of the full blocks of all_token_ids, filled by the KV cache manager.
        self.block_hashes: list[int] = []
        self.num_preemptions = 0
        # A StructuredOutputRequest (v1/structured_output) when the output is constrained.
        self.structured_output_request = None
        self.lora_request = lora_request
        # Speculative decoding: tokens proposed for the next step, verified by the model then.
        self.spec_token_ids: list[int] = []

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def drop_last_output_tokens(self, num_tokens: int) -> None:
        """Forgets the last output tokens (a stop string ended the text before them)."""
        if num_tokens > 0:
            del self.output_token_ids[-num_tokens:]
            del self._all_token_ids[-num_tokens:]

    def get_finished_reason(self) -> str | None:
        """"stop", "length", "abort", or None while the request runs."""
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
