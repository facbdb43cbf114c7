"""vLLM's decode-context-parallel query projection, refused: minivllm has no DCP groups."""

from typing import Any

from torch import nn


class DCPGroupColumnParallelLinear(nn.Module):
    """A column-parallel linear whose shard spans a decode-context-parallel group (DCP > 1);
    building one raises, since minivllm runs with decode_context_parallel_size = 1."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("decode context parallelism (DCPGroupColumnParallelLinear) "
                                  "is not supported; use decode_context_parallel_size=1")
