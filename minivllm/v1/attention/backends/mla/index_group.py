"""Sparse-MLA index groups (DeepSeek-V3.2's top-k token selection): not supported on CPU.

The names exist because model files import them at module level; building one raises.
"""

from typing import Any

_UNSUPPORTED = ("sparse MLA (DeepSeek-V3.2's index_topk indexer) is not supported by minivllm; "
                "dense MLA (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash) is")


class SparseMLAIndexGroupBuilder:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_UNSUPPORTED)


def get_sparse_mla_index_group_max_rows(vllm_config: Any) -> int:
    raise NotImplementedError(_UNSUPPORTED)
