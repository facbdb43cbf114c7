"""Token-wise pooling (vLLM's `pooler.tokwise` surface): one output per token."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.config import PoolerConfig
from minivllm.model_executor.layers.pooler.tokwise import (AllPool, get_tok_pooling_method,
                                                           pooler_for_token_classify,
                                                           pooler_for_token_embed)

HIDDEN, LENS = torch.randn(7, 4), [3, 4]


def test_all_pool_splits_rows_per_prompt():
    pieces = AllPool()(HIDDEN, LENS)
    assert [p.shape for p in pieces] == [(3, 4), (4, 4)]
    torch.testing.assert_close(torch.cat(pieces), HIDDEN)


def test_token_embed_normalises_each_token_unless_told_not():
    pooler = pooler_for_token_embed(PoolerConfig(pooling_type="ALL"))
    assert pooler.get_supported_tasks() == {"token_embed"}
    out = pooler(HIDDEN, LENS)
    torch.testing.assert_close(torch.cat(out), F.normalize(HIDDEN, dim=-1))
    raw = pooler_for_token_embed(PoolerConfig(pooling_type="ALL", normalize=False))
    torch.testing.assert_close(torch.cat(raw(HIDDEN, LENS)), HIDDEN)


def test_token_classify_gives_per_token_logits():
    classifier = torch.nn.Linear(4, 3)
    pooler = pooler_for_token_classify(PoolerConfig(), classifier=classifier)
    assert pooler.get_supported_tasks() == {"token_classify"}
    out = pooler(HIDDEN, LENS)
    assert [o.shape for o in out] == [(3, 3), (4, 3)]
    torch.testing.assert_close(torch.cat(out), classifier(HIDDEN))


def test_step_pooling_is_refused_by_name():
    assert isinstance(get_tok_pooling_method("all"), AllPool)
    with pytest.raises(ValueError, match="choose ALL"):
        get_tok_pooling_method("STEP")
