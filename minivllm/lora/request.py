"""LoRARequest: which adapter a request uses (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoRARequest:
    """An adapter named `lora_name`, identified in the engine by `lora_int_id` (>= 1; 0 is the
    base model), read from the PEFT folder `lora_path`.

    Two requests are the same adapter when their `lora_int_id` is equal: the id keys the
    workers' adapter cache and the prefix cache.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None)
    long_lora_max_len: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 means the base model), "
                             f"got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __hash__(self) -> int:
        return hash(self.lora_int_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id
