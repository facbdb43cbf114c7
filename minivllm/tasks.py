"""vLLM's task names: what a generation or pooling model can be asked to do."""

from typing import Literal, get_args

GenerationTask = Literal["generate"]
GENERATION_TASKS: tuple[GenerationTask, ...] = get_args(GenerationTask)

# One vector per sequence (embed, classify) or per token (token_*); "embed&token_classify" is
# BGE-M3's combined task. minivllm's pooling engine runs one of them per model.
PoolingTask = Literal["embed", "classify", "token_embed", "token_classify", "plugin",
                      "embed&token_classify"]
POOLING_TASKS: tuple[PoolingTask, ...] = get_args(PoolingTask)

ScoreType = Literal["bi-encoder", "cross-encoder", "late-interaction"]

__all__ = ["GENERATION_TASKS", "GenerationTask", "POOLING_TASKS", "PoolingTask", "ScoreType"]
