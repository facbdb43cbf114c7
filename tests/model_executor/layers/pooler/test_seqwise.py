"""Sequence-wise pooling methods, heads and poolers (vLLM's `pooler.seqwise` surface)."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.config import PoolerConfig
from minivllm.model_executor.layers.pooler import Pooler
from minivllm.model_executor.layers.pooler.seqwise import (CLSPool, ClassifierPoolerHead,
                                                           EmbeddingPoolerHead, LastPool, MeanPool,
                                                           SequencePooler,
                                                           get_seq_pooling_method,
                                                           pooler_for_classify, pooler_for_embed)

HIDDEN, LENS = torch.randn(7, 4), [3, 4]       # two prompts: rows 0..2 and 3..6


@pytest.mark.parametrize("name,cls,rows", [("CLS", CLSPool, [0, 3]), ("last", LastPool, [2, 6])])
def test_cls_and_last_pick_one_row_per_prompt(name, cls, rows):
    method = get_seq_pooling_method(name)
    assert isinstance(method, cls)
    torch.testing.assert_close(method(HIDDEN, LENS), HIDDEN[rows])


def test_mean_averages_each_prompt():
    expected = torch.stack([HIDDEN[:3].mean(0), HIDDEN[3:].mean(0)])
    torch.testing.assert_close(MeanPool()(HIDDEN, LENS), expected)


def test_token_pooling_type_is_not_a_sequence_method():
    with pytest.raises(ValueError, match="CLS"):
        get_seq_pooling_method("ALL")
    with pytest.raises(ValueError, match="choose one of"):
        get_seq_pooling_method("median")


def test_embedding_head_projects_then_normalises_only_when_asked():
    proj = torch.nn.Linear(4, 3)
    pooled = HIDDEN[[0, 3]]
    raw = EmbeddingPoolerHead(projector=proj)(pooled, LENS)
    torch.testing.assert_close(raw, proj(pooled))
    normed = EmbeddingPoolerHead(projector=proj, activation=lambda x: F.normalize(x, dim=-1))
    torch.testing.assert_close(normed(pooled, LENS), F.normalize(proj(pooled), dim=-1))


def test_sequence_pooler_is_a_pooler_and_reports_its_task():
    embed = pooler_for_embed(PoolerConfig(pooling_type="MEAN"))
    assert isinstance(embed, Pooler) and embed.get_supported_tasks() == {"embed"}
    means = torch.stack([HIDDEN[:3].mean(0), HIDDEN[3:].mean(0)])
    torch.testing.assert_close(embed(HIDDEN, LENS), F.normalize(means, dim=-1))
    unnormalised = pooler_for_embed(PoolerConfig(pooling_type="LAST", normalize=False))
    torch.testing.assert_close(unnormalised(HIDDEN, LENS), HIDDEN[[2, 6]])


def test_classifier_on_a_model_files_own_pooling():
    """As bert.py's `for_seq_cls(pooling=self.bert.pooler, ...)`: a SequencePooler (CLS, then a
    tanh projection) is the pooling of the classifier; logits come back raw."""
    dense, classifier = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    bert_pooler = SequencePooler(CLSPool(), EmbeddingPoolerHead(lambda x: torch.tanh(dense(x))))
    scores = pooler_for_classify(PoolerConfig(), pooling=bert_pooler, classifier=classifier)
    assert scores.get_supported_tasks() == {"classify"}
    torch.testing.assert_close(scores(HIDDEN, LENS), classifier(torch.tanh(dense(HIDDEN[[0, 3]]))))
    head = ClassifierPoolerHead(classifier, activation=lambda x: x.softmax(-1))
    torch.testing.assert_close(head(HIDDEN[[0, 3]], LENS), classifier(HIDDEN[[0, 3]]).softmax(-1))
