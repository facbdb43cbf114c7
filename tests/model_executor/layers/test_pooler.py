"""The Pooler's token-wise (ALL) pooling and its construction from a PoolerConfig."""

import torch
import torch.nn.functional as F

from minivllm.config.pooler import PoolerConfig
from minivllm.model_executor.layers.pooler import Pooler, PoolingType


def test_all_pooling_splits_per_sequence():
    hidden = torch.randn(6, 4)
    out = Pooler(PoolingType.ALL, normalize=False)(hidden, [2, 4])
    assert [t.shape for t in out] == [(2, 4), (4, 4)]
    assert torch.equal(out[1], hidden[2:])
    normed = Pooler("all")(hidden, [6])
    assert torch.allclose(normed[0], F.normalize(hidden, dim=-1))


def test_from_pooler_config():
    pooler = Pooler.from_pooler_config(PoolerConfig(pooling_type="MEAN", normalize=False))
    hidden = torch.randn(5, 3)
    assert pooler.pooling_type == PoolingType.MEAN and not pooler.normalize
    assert torch.allclose(pooler(hidden, [5])[0], hidden.mean(0), atol=1e-6)


def test_dispatch_pooler_runs_the_pooler_of_its_task():
    import pytest

    from minivllm.model_executor.layers.pooler import DispatchPooler

    hidden, lens = torch.randn(7, 4), [3, 4]
    head = torch.nn.Linear(4, 2, bias=False)
    classify = DispatchPooler.for_seq_cls(PoolerConfig(pooling_type="MEAN"), classifier=head)
    assert classify.get_supported_tasks() == {"classify"}
    means = torch.stack([hidden[:3].mean(0), hidden[3:].mean(0)])
    torch.testing.assert_close(classify(hidden, lens), head(means))
    embed = DispatchPooler.for_embedding(PoolerConfig(pooling_type="LAST", normalize=True))
    torch.testing.assert_close(embed(hidden, lens), F.normalize(hidden[[2, 6]], dim=-1))
    with pytest.raises(ValueError, match="no pooler for task 'embed'"):
        DispatchPooler({"classify": classify.poolers_by_task["classify"]}, task="embed")
