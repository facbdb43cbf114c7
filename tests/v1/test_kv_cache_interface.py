"""vLLM's KV-cache specs: an MLA page holds one latent row per token, half a K + V page."""

import torch

from minivllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SparseCacheRole


def test_mla_page_is_one_row_per_token():
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                           cache_role=SparseCacheRole.INDEXER)
    assert full.page_size_bytes == 2 * 16 * 576 * 2
    assert mla.page_size_bytes == full.page_size_bytes // 2
