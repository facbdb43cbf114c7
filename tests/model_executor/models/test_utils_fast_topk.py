"""`fast_topk` and `ShardIds` (vLLM 0.33's models/utils names Llama 4's and Gemma 4's files use)."""

import pytest
import torch

from minivllm.model_executor.models.utils import ShardIds, WeightsMapper, fast_topk


@pytest.mark.parametrize("k", [1, 3])
def test_fast_topk_is_topk(k):
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    values, indices = fast_topk(x, k, dim=-1)
    ref = torch.topk(x, k, dim=-1)
    assert values.shape == (5, k)
    torch.testing.assert_close(values, ref.values)
    assert torch.equal(indices, ref.indices)


def test_a_list_of_shard_ids_loads_the_weight_into_each():
    target: tuple[str, ShardIds] = (".qkv_proj.", ["k", "v"])
    mapper = WeightsMapper(orig_to_new_stacked={".k_proj.": target})
    out = list(mapper.apply([("layers.0.k_proj.weight", torch.ones(2))]))
    assert [(name, t.shard_id) for name, t in out] == [("layers.0.qkv_proj.weight", "k"),
                                                       ("layers.0.qkv_proj.weight", "v")]
