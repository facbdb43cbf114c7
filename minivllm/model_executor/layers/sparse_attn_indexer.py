"""DeepSeek-V3.2's sparse-attention indexer: not supported on CPU.

The names exist because vLLM's DeepSeek file imports them at module level; using one raises.
"""

from typing import Any

from torch import nn

from minivllm.v1.attention.backends.mla.index_group import _UNSUPPORTED


class SparseAttnIndexer(nn.Module):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_UNSUPPORTED)


def fused_indexer_q_rope_quant(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(_UNSUPPORTED)
