"""LLM.classify and LLM.score on tiny random sequence-classification checkpoints (Llama and
Qwen3, found through their causal-LM class) against transformers (fp32): class probabilities,
cross-encoder scores of text pairs, and the cosine scores of an embedding model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import (LlamaConfig, LlamaForSequenceClassification, Qwen3Config,
                          Qwen3ForSequenceClassification)

from minivllm import LLM
from tests.entrypoints.openai._helpers import TEXTS, make_tokenizer, write_tiny_checkpoint

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
QUERY = "Hello world, how are you today?"


def write_classifier(folder: str, config_cls, model_cls, num_labels: int, **extra) -> str:
    """A random `*ForSequenceClassification` and the test tokenizer, in one HF folder."""
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = config_cls(vocab_size=len(tokenizer), num_labels=num_labels, **SMALL, **extra)
    model_cls(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def hf_logits(folder: str, model_cls, ids: list[int]) -> torch.Tensor:
    model = model_cls.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", max_model_len=128, num_gpu_blocks_override=64, **kwargs)


@pytest.mark.parametrize("config_cls, model_cls, extra", [
    (LlamaConfig, LlamaForSequenceClassification, {}),
    (Qwen3Config, Qwen3ForSequenceClassification, {"head_dim": 16}),
])
def test_classify_equals_transformers_softmax(tmp_path, config_cls, model_cls, extra):
    path = write_classifier(str(tmp_path), config_cls, model_cls, 3, id2label=LABELS, **extra)
    llm = _llm(path)
    outputs = llm.classify(TEXTS, use_tqdm=False)
    raw = llm.encode(TEXTS, use_tqdm=False)      # the "encode" task: the logits themselves
    for text, out, logits in zip(TEXTS, outputs, raw):
        ref = hf_logits(path, model_cls, llm.tokenizer.encode(text))
        assert out.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(out.outputs.probs), ref.softmax(-1), atol=1e-5,
                                   rtol=1e-4)
        torch.testing.assert_close(logits.outputs.data, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="use LLM.classify"):
        llm.embed(TEXTS[:1])
    with pytest.raises(ValueError, match="classification model with 3 labels"):
        llm.score(QUERY, TEXTS)
    llm.shutdown()


def test_score_of_a_cross_encoder_equals_transformers_sigmoid(tmp_path):
    path = write_classifier(str(tmp_path), LlamaConfig, LlamaForSequenceClassification, 1)
    llm = _llm(path)
    tokenizer = llm.tokenizer
    one_to_n = llm.score(QUERY, TEXTS, use_tqdm=False)
    pairwise = llm.score(TEXTS, list(reversed(TEXTS)), use_tqdm=False)
    for outputs, pairs in ((one_to_n, [(QUERY, t) for t in TEXTS]),
                           (pairwise, list(zip(TEXTS, reversed(TEXTS))))):
        assert len(outputs) == len(pairs)
        for out, (a, b) in zip(outputs, pairs):
            ids = tokenizer(text=a, text_pair=b)["input_ids"]
            ref = hf_logits(path, LlamaForSequenceClassification, ids).sigmoid()
            assert out.prompt_token_ids == ids
            assert out.outputs.score == pytest.approx(float(ref[0]), abs=1e-5)
    assert len({round(o.outputs.score, 6) for o in one_to_n}) == len(TEXTS)   # not constant
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 has 4"):
        llm.score(TEXTS[:2], TEXTS)
    with pytest.raises(ValueError, match="text_2 must be a text or a non-empty list"):
        llm.score(QUERY, [])
    llm.shutdown()


def test_score_of_an_embedding_model_is_the_cosine(tmp_path):
    path = write_tiny_checkpoint(str(tmp_path))
    llm = _llm(path, convert="embed")
    scores = llm.score(QUERY, TEXTS, use_tqdm=False)
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed([QUERY, *TEXTS],
                                                                     use_tqdm=False)]
    for out, vector in zip(scores, vectors[1:]):
        assert out.outputs.score == pytest.approx(float(F.cosine_similarity(
            vectors[0], vector, dim=0)), abs=1e-5)
    with pytest.raises(ValueError, match="use LLM.embed"):
        llm.classify(TEXTS[:1])
    llm.shutdown()
