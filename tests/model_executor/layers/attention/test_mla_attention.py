"""MLAAttention's contract edges: one latent row per token in the cache, and what it refuses
(sparse MLA, a biased kv_b_proj, features the CPU MLA backend lacks). The numerics are checked
end to end against transformers in tests/model_executor/models/test_deepseek_v2.py."""

import pytest

from minivllm.model_executor.layers.attention import MLAAttention, RSWAAttention
from minivllm.model_executor.layers.attention.backends.cpu_mla_attn import CPUMLAImpl
from minivllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   DCPGroupColumnParallelLinear)
from minivllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
from tests.model_executor.layers._helpers import layer_context

GEOMETRY = dict(num_heads=4, scale=0.2, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                q_lora_rank=None, kv_lora_rank=32)


def test_latent_cache_row_and_refusals():
    with layer_context():
        kv_b = ColumnParallelLinear(32, 4 * (16 + 12), bias=False, prefix="kv_b")
        mla = MLAAttention(**GEOMETRY, kv_b_proj=kv_b, prefix="layers.0.attn")
        assert mla.get_kv_cache_shape(6, 4) == (6, 4, 40)     # kv_lora_rank + rope dims
        assert mla.num_kv_heads == 1 and mla.head_size_v == 12
        with pytest.raises(NotImplementedError, match="V3.2"):
            MLAAttention(**GEOMETRY, kv_b_proj=kv_b, prefix="layers.1.attn", use_sparse=True)
        biased = ColumnParallelLinear(32, 4 * 28, bias=True, prefix="biased")
        with pytest.raises(ValueError, match="no bias"):
            MLAAttention(**GEOMETRY, kv_b_proj=biased, prefix="layers.2.attn")
        with pytest.raises(NotImplementedError, match="sliding_window, logits_soft_cap"):
            CPUMLAImpl(4, 40, 0.2, 1, None, 8, "auto", 30.0, kv_lora_rank=32,
                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def test_vllm_only_features_are_refused_by_name():
    with layer_context():
        with pytest.raises(NotImplementedError, match="rswa_window=64"):
            RSWAAttention(4, 16, 0.25, prefix="rswa.attn", rswa_window=64)
        plain = RSWAAttention(4, 16, 0.25, prefix="rswa0.attn", rswa_window=0)
        assert plain.num_heads == 4
        with pytest.raises(NotImplementedError, match="decode_context_parallel_size=1"):
            DCPGroupColumnParallelLinear(32, 32)
        with pytest.raises(NotImplementedError, match="V3.2"):
            SparseAttnIndexer()
