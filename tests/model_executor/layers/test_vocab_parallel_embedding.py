"""Vocab padding, per-rank masking, LM-head tying and the LogitsProcessor."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.quantization import QuantizeMethodBase
from minivllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding,
                                                                     pad_vocab_size)
from tests.model_executor.layers._helpers import layer_context

V, H = 100, 8


class FakeGroup:
    """A TP group of `world_size` in which this process is `rank`; collectives are identities."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank_in_group, self.world_size = rank, world_size

    def all_reduce(self, x):
        return x


@pytest.fixture
def ctx():
    with layer_context() as config:
        yield config


def test_pad_vocab_size():
    assert [pad_vocab_size(n) for n in (1, 64, 65, 100, 128256)] == [64, 64, 128, 128, 128256]
    assert pad_vocab_size(100, 32) == 128


def test_embedding_pads_and_zero_fills(ctx):
    table = torch.randn(V, H)
    embed = VocabParallelEmbedding(V, H)
    assert embed.weight.shape == (128, H) and embed.num_embeddings_padded == 128
    embed.weight.data.fill_(7.0)
    embed.weight.weight_loader(embed.weight, table)
    torch.testing.assert_close(embed.weight.data[:V], table)
    assert embed.weight.data[V:].abs().sum() == 0
    ids = torch.tensor([[0, 3], [99, 50]])
    torch.testing.assert_close(embed(ids), F.embedding(ids, table))
    with pytest.raises(AssertionError, match="expects 100 rows"):
        embed.weight.weight_loader(embed.weight, torch.randn(128, H))


def test_embedding_ranks_mask_foreign_ids(ctx):
    table, ids = torch.randn(V, H), torch.tensor([0, 31, 32, 63, 64, 99])
    outputs = []
    for rank in range(4):  # padded 128 / 4 = 32 rows per rank
        embed = VocabParallelEmbedding(V, H, parallel_group=FakeGroup(rank, 4))
        embed.weight.weight_loader(embed.weight, table)
        assert embed.weight.shape == (32, H)
        si = embed.shard_indices
        assert (si.org_vocab_start_index, si.org_vocab_end_index) == (32 * rank, min(V, 32 * rank + 32))
        out = embed(ids)
        owned = (ids >= si.org_vocab_start_index) & (ids < si.org_vocab_end_index)
        assert out[~owned].abs().sum() == 0
        outputs.append(out)
    torch.testing.assert_close(sum(outputs), F.embedding(ids, table))


def test_lm_head_tying_and_direct_call(ctx):
    embed = VocabParallelEmbedding(V, H)
    head = ParallelLMHead(V, H, bias=True)
    assert head.bias.shape == (128,)
    tied = head.tie_weights(embed)
    assert tied is head and tied.weight is embed.weight
    assert dict(tied.named_parameters())["weight"] is embed.weight
    with pytest.raises(RuntimeError, match="LMHead's weights should be used in the sampler."):
        head(torch.tensor([1]))


def test_quant_method_without_embedding_is_rejected_for_embeddings_only(ctx):
    class HeadOnly(QuantizeMethodBase):
        def create_weights(self, layer, *args, **extra):
            layer.register_parameter("weight", torch.nn.Parameter(torch.empty(args[1][0], args[0])))

        def apply(self, layer, x, bias=None):
            return F.linear(x, layer.weight, bias)

    with pytest.raises(NotImplementedError, match="must implement the 'embedding' method"):
        VocabParallelEmbedding(V, H, quant_method=HeadOnly())
    assert isinstance(ParallelLMHead(V, H, quant_method=HeadOnly()).quant_method, HeadOnly)


def test_logits_processor_slices_caps_and_scales(ctx):
    head = ParallelLMHead(V, H)
    w = torch.randn(V, H)
    head.weight.weight_loader(head.weight, w)
    hidden = torch.randn(5, H)
    full = F.linear(hidden, w)
    torch.testing.assert_close(LogitsProcessor(V)(head, hidden), full)
    assert LogitsProcessor(V)(head, hidden, skip_gather=True).shape == (5, 128)
    torch.testing.assert_close(LogitsProcessor(V, org_vocab_size=90)(head, hidden), full[:, :90])
    capped = LogitsProcessor(V, scale=0.5, soft_cap=2.0)(head, hidden)
    torch.testing.assert_close(capped, torch.tanh(full / 2.0) * 2.0 * 0.5)
    torch.testing.assert_close(LogitsProcessor(V, logits_as_input=True, scale=2.0)(head, full),
                               full * 2)
    bias = torch.randn(128)
    torch.testing.assert_close(LogitsProcessor(V)(head, hidden, embedding_bias=bias),
                               full + bias[:V])


def test_get_top_tokens_is_argmax_over_real_vocab(ctx):
    head = ParallelLMHead(V, H)
    head.weight.weight_loader(head.weight, torch.randn(V, H))
    head.weight.data[V:] = 100.0  # padding rows must never win
    hidden = torch.randn(6, H)
    processor = LogitsProcessor(V)
    top = processor.get_top_tokens(head, hidden)
    torch.testing.assert_close(top, processor(head, hidden).argmax(-1))
    values, ids = processor.get_top_k_tokens(head, hidden, 3)
    assert ids.shape == (6, 3) and torch.equal(ids[:, 0], top)
