"""Wrapping poolers: DispatchPooler's task checks, BGE-M3's combined output, BOSEOSFilter."""

import pytest
import torch

from minivllm.config import PoolerConfig
from minivllm.model_executor.layers.pooler import (BgeM3Pooler, BOSEOSFilter, DispatchPooler,
                                                   IdentityPooler, PoolingParamsUpdate)
from minivllm.model_executor.layers.pooler.seqwise import pooler_for_embed
from minivllm.model_executor.layers.pooler.tokwise import (pooler_for_token_classify,
                                                           pooler_for_token_embed)

HIDDEN, LENS = torch.randn(7, 4), [3, 4]


def test_dispatch_pooler_refuses_a_pooler_for_the_wrong_task():
    with pytest.raises(ValueError, match="does not support task 'classify'"):
        DispatchPooler({"classify": pooler_for_embed(PoolerConfig())})


def test_for_embedding_builds_the_task_the_config_pools():
    tokens = DispatchPooler.for_embedding(PoolerConfig(pooling_type="ALL"))
    assert tokens.get_supported_tasks() == {"token_embed"}
    assert [o.shape for o in tokens(HIDDEN, LENS)] == [(3, 4), (4, 4)]
    assert DispatchPooler.for_embedding(PoolerConfig(pooling_type="CLS")).task == "embed"


def test_bge_m3_concatenates_embedding_and_token_scores():
    classifier = torch.nn.Linear(4, 1)
    embed = pooler_for_embed(PoolerConfig(pooling_type="CLS"))
    pooler = BgeM3Pooler(pooler_for_token_classify(PoolerConfig(), classifier=classifier), embed)
    out = pooler(HIDDEN, LENS)
    assert [o.shape for o in out] == [(4 + 3,), (4 + 4,)]
    torch.testing.assert_close(out[1][4:], classifier(HIDDEN[3:]).flatten())


def test_bos_eos_filter_asks_for_token_ids_and_refuses_to_run_without_them():
    wrapped = BOSEOSFilter(pooler_for_token_embed(PoolerConfig(pooling_type="ALL")), 1, 2)
    expected = PoolingParamsUpdate(requires_token_ids=True)
    assert wrapped.get_pooling_updates("token_embed") == expected
    with pytest.raises(NotImplementedError, match="token ids"):
        wrapped(HIDDEN, LENS)


def test_identity_pooler_returns_the_hidden_states():
    assert IdentityPooler()(HIDDEN, LENS) is HIDDEN
