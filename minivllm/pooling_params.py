"""PoolingParams: what a pooling request asks for (vLLM's `vllm.pooling_params`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POOLING_TASKS = ("embed", "encode")


@dataclass
class PoolingParams:
    """`truncate_prompt_tokens`: keep only the last k prompt tokens; `dimensions`: cut a
    matryoshka model's embeddings to this size (renormalised when the pooler normalises);
    `task`: "embed" (one vector per prompt) or "encode" (whatever the pooler gives)."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task {self.task!r}; choose one of {', '.join(POOLING_TASKS)}")
        for name in ("truncate_prompt_tokens", "dimensions"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def n(self) -> int:
        """One output per request (admission counts sequences by `n`, as for SamplingParams)."""
        return 1

    def verify(self, model_config: Any) -> None:
        """Checks `dimensions` against the model (a ValueError naming what it supports)."""
        if self.dimensions is None:
            return
        if not getattr(model_config, "is_matryoshka", False):
            raise ValueError(f"dimensions: model {getattr(model_config, 'served_model_name', '')!r} "
                             "does not support matryoshka representation, so its embeddings "
                             "cannot be shortened; omit `dimensions`")
        allowed = getattr(model_config, "matryoshka_dimensions", None)
        hidden_size = getattr(model_config.hf_text_config, "hidden_size", None)
        if hidden_size is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions: {self.dimensions} is more than the model's "
                             f"{hidden_size} dimensions")
        if allowed and self.dimensions not in allowed:
            raise ValueError(f"dimensions: {self.dimensions} is not supported; this model "
                             f"supports {sorted(allowed)}")
