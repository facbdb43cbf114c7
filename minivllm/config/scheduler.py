"""SchedulerConfig: one token budget per step."""

from dataclasses import dataclass


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048   # token budget shared by decodes and prefill chunks
    max_num_seqs: int = 128              # at most this many running requests
    # NOTE: always True: with one token budget and no prefill phase, every prefill may be
    # chunked; the field keeps vLLM's name and rejects what minivllm cannot do.
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0   # cap on a request's new tokens per step; 0: none
    max_num_queued_requests: int = 1024  # server backpressure bound
    policy: str = "fcfs"                 # or "priority": requests' priority, then arrival

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"Unknown scheduling policy {self.policy!r}; choose one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        if self.enable_chunked_prefill is not True:
            raise ValueError("enable_chunked_prefill must be True: minivllm always chunks prefills "
                             f"to the step's token budget, got {self.enable_chunked_prefill!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap), got "
                             f"{self.long_prefill_token_threshold}")
