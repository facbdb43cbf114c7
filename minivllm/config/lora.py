"""LoRAConfig: how many adapters a step may use and how large they may be (vLLM's LoRAConfig)."""

from dataclasses import dataclass

import torch

_LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class LoRAConfig:
    """`max_loras` adapter slots serve one step; up to `max_cpu_loras` loaded adapters wait
    behind them (least recently used first out). `lora_dtype` "auto" is the model's dtype."""

    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int | None = None
    lora_dtype: str | torch.dtype = "auto"

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if isinstance(self.lora_dtype, str) and self.lora_dtype not in _LORA_DTYPES:
            raise ValueError(f"Unknown lora_dtype {self.lora_dtype!r}; choose one of "
                             f"{', '.join(_LORA_DTYPES)}")

    def resolve_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the adapter tables: `lora_dtype`, or the model's for "auto"."""
        if isinstance(self.lora_dtype, torch.dtype):
            return self.lora_dtype
        return model_dtype if self.lora_dtype == "auto" else getattr(torch, self.lora_dtype)
