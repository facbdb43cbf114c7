"""SchedulerConfig: one token budget per step."""

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048   # token budget shared by decodes and prefill chunks
    max_num_seqs: int = 128              # at most this many running requests
    enable_chunked_prefill: bool = True
    max_num_queued_requests: int = 1024  # server backpressure bound

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
