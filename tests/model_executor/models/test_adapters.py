"""as_embedding_model / as_seq_cls_model and the small Pooler."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from minivllm.config import ModelConfig, VllmConfig
from minivllm.distributed import ensure_model_parallel_initialized
from minivllm.model_executor.layers.pooler import Pooler, PoolingType
from minivllm.model_executor.model_loader.utils import initialize_model
from minivllm.model_executor.models.adapters import as_embedding_model, as_seq_cls_model
from minivllm.model_executor.models.interfaces import SupportsCrossEncoding
from minivllm.model_executor.models.interfaces_base import is_pooling_model
from minivllm.model_executor.models.utils import StageMissingLayer

HIDDEN = 64


def _config(**kw) -> VllmConfig:
    hf = LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     architectures=["LlamaForCausalLM"], **kw)
    return VllmConfig(model_config=ModelConfig(model="dummy", hf_config=hf, dtype="float32"))


class Plain(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()


def test_adapters_work_at_import_time_without_config():
    emb, cls = as_embedding_model(Plain), as_seq_cls_model(Plain)
    assert emb.__name__ == "PlainEmbeddingModel" and emb.is_pooling_model
    assert cls.__name__ == "PlainForSequenceClassification" and SupportsCrossEncoding in cls.__mro__
    assert issubclass(emb, Plain) and as_embedding_model(emb) is emb   # already pooling


@pytest.mark.parametrize("pooling,expected_rows", [("LAST", [1, 4]), ("CLS", [0, 2])])
def test_pooler_index_pooling(pooling, expected_rows):
    hidden = torch.randn(5, 3)
    out = Pooler(pooling)(hidden, [2, 3])
    assert torch.allclose(out, F.normalize(hidden[expected_rows], dim=-1))


def test_pooler_mean_and_head():
    hidden = torch.randn(6, 4)
    lens = torch.tensor([1, 2, 3])
    expected = torch.stack([hidden[0], hidden[1:3].mean(0), hidden[3:].mean(0)])
    assert torch.allclose(Pooler(PoolingType.MEAN, normalize=False)(hidden, lens), expected, atol=1e-6)
    head = nn.Linear(4, 2)
    scores = Pooler.for_seq_cls(head, "mean")(hidden, lens)
    assert torch.allclose(scores, head(expected), atol=1e-6)
    with pytest.raises(ValueError, match="choose one of"):
        Pooler("median")


def test_embedding_llama_builds_loads_and_pools(tmp_path):
    from minivllm.model_executor.models.llama import LlamaForCausalLM as MiniLlama

    ensure_model_parallel_initialized(1, 1)
    cfg = _config(tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg.model_config.hf_config).save_pretrained(tmp_path)
    model = initialize_model(cfg, model_class=as_embedding_model(MiniLlama))
    assert is_pooling_model(model)
    assert isinstance(model.lm_head, StageMissingLayer) and isinstance(model.logits_processor, StageMissingLayer)
    assert not any(n.startswith("lm_head") for n, _ in model.named_parameters())
    with pytest.raises(RuntimeError):
        model.compute_logits(torch.zeros(1, HIDDEN))

    from minivllm.model_executor.model_loader.weight_iterators import safetensors_weights_iterator

    loaded = model.load_weights(safetensors_weights_iterator(str(tmp_path)))
    assert {n for n, _ in model.named_parameters()} <= loaded and "lm_head.weight" not in loaded
    hidden = torch.randn(7, HIDDEN)
    emb = model.pooler(hidden, [3, 4])
    assert emb.shape == (2, HIDDEN) and torch.allclose(emb.norm(dim=-1), torch.ones(2))


def test_seq_cls_llama_scores_with_tied_head():
    from minivllm.model_executor.models.llama import LlamaForCausalLM as MiniLlama

    ensure_model_parallel_initialized(1, 1)
    cfg = _config(tie_word_embeddings=True, num_labels=3)
    model = initialize_model(cfg, model_class=as_seq_cls_model(MiniLlama))
    assert model.model.embed_tokens.weight.device.type == "cpu"   # tied head's weight survives
    names = {n for n, _ in model.named_parameters()}
    assert "score.weight" in names and not any(n.startswith("lm_head") for n in names)
    scores = model.pooler(torch.randn(5, HIDDEN), [5])
    assert scores.shape == (1, 3)
