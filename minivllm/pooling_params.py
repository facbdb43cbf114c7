"""PoolingParams: what a pooling request asks for (vLLM's `vllm.pooling_params`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POOLING_TASKS = ("embed", "classify", "encode")
# What each task asks of the model's pooler (ModelConfig.pooling_task); "encode" takes either.
_TASK_NEEDS = {"embed": ("embed", "LLM.embed", "/v1/embeddings"),
               "classify": ("classify", "LLM.classify", "/classify")}


@dataclass
class PoolingParams:
    """`truncate_prompt_tokens`: keep only the last k prompt tokens; `dimensions`: cut a
    matryoshka model's embeddings to this size (renormalised when the pooler normalises);
    `task`: "embed" (one vector per prompt), "classify" (class probabilities of a
    classification model) or "encode" (the pooler's raw output); `use_activation`: classify's
    softmax (sigmoid for one label or multi-label models) over the logits, on unless False."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    task: str = "embed"
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task {self.task!r}; choose one of {', '.join(POOLING_TASKS)}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be true, false or None, got {self.use_activation!r}")
        for name in ("truncate_prompt_tokens", "dimensions"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def n(self) -> int:
        """One output per request (admission counts sequences by `n`, as for SamplingParams)."""
        return 1

    def verify(self, model_config: Any) -> None:
        """Checks the task and `dimensions` against the model (a ValueError naming what it
        supports)."""
        model_task = getattr(model_config, "pooling_task", None)
        needed = _TASK_NEEDS.get(self.task)
        if needed is not None and model_task is not None and model_task != needed[0]:
            have = _TASK_NEEDS[model_task]
            raise ValueError(f"The {self.task} task needs a model whose pooler does {needed[0]} "
                             f"({needed[1]}, {needed[2]}); this model's does {model_task}: use "
                             f"{have[1]} (or {have[2]}), or LLM.score / /score.")
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
