"""vLLM 0.33.0's embedding / classification model files (bert.py, roberta.py, modernbert.py,
colbert.py, lfm2.py), import root renamed, through minivllm's pooling engine against
transformers (fp32).

Each file's class is registered over the architecture, a tiny random transformers checkpoint is
written, and `LLM(runner="pooling")` embeds or classifies token-id prompts: pooled and
L2-normalised embeddings, per-token ColBERT embeddings and classifier logits equal
transformers' within 1e-4. ~30 s on 2 cores. lfm2.py's
Lfm2ForCausalLM is a generation model (short convolutions beside attention): greedy tokens
identical and prompt logprobs within 1e-4.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.model_executor.models._family_helpers import (assert_matches_transformers,
                                                         make_prompts, write_tiny_checkpoint)

_ENCODER = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=128, num_key_value_heads=None,
                rms_norm_eps=None, tie_word_embeddings=None, bos_token_id=None,
                eos_token_id=None)
# Prompts avoid id 0 and 1 (RoBERTa's pad id: its positions count non-pad tokens).
PROMPTS = [[5, 17, 300, 42, 7, 9], list(range(10, 60)), [11, 12, 13]]
_MODERNBERT = dict(_ENCODER, global_attn_every_n_layers=2, local_attention=16,
                   num_hidden_layers=3, pad_token_id=0)

# case -> (vLLM file, architecture, vLLM class, transformers class, config class, overrides,
#          pooling type)
EMBED_CASES = {
    "bert_cls": ("bert", "BertModel", "BertEmbeddingModel", "BertModel", "BertConfig", {}, "CLS"),
    # None: no pooler_config, BertEmbeddingModel's `@default_pooling_type` (CLS) applies.
    "bert_default": ("bert", "BertModel", "BertEmbeddingModel", "BertModel", "BertConfig", {},
                     None),
    "bert_mean": ("bert", "BertModel", "BertEmbeddingModel", "BertModel", "BertConfig", {},
                  "MEAN"),
    "roberta_cls": ("roberta", "RobertaModel", "RobertaEmbeddingModel", "RobertaModel",
                    "RobertaConfig", dict(pad_token_id=1), "CLS"),
    "xlm_roberta_mean": ("roberta", "XLMRobertaModel", "RobertaEmbeddingModel",
                         "XLMRobertaModel", "XLMRobertaConfig", dict(pad_token_id=1), "MEAN"),
    # Alternating local (window 16, both sides) and global layers; the 50-token prompt spans
    # several windows.
    "modernbert_mean": ("modernbert", "ModernBertModel", "ModernBertModel", "ModernBertModel",
                        "ModernBertConfig", _MODERNBERT, "MEAN"),
}
CLASSIFY_CASES = {
    "bert": ("bert", "BertForSequenceClassification", "BertConfig", {}),
    "roberta": ("roberta", "RobertaForSequenceClassification", "RobertaConfig",
                dict(pad_token_id=1)),
    "modernbert": ("modernbert", "ModernBertForSequenceClassification", "ModernBertConfig",
                   dict(_MODERNBERT, classifier_pooling="mean")),
}


def _checkpoint(tmp_path, config_name: str, model_name: str, overrides: dict) -> str:
    return write_tiny_checkpoint(tmp_path, getattr(transformers, config_name),
                                 getattr(transformers, model_name),
                                 **dict(_ENCODER, **overrides))


def _reference_embedding(hf, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf(torch.tensor([ids])).last_hidden_state[0]       # [n, H]
    pooled = hidden[0] if pooling == "CLS" else hidden.mean(0)
    return F.normalize(pooled, dim=-1)


@pytest.mark.parametrize("case", list(EMBED_CASES))
def test_vllm_encoder_file_embeddings_match_transformers(case, registered_vllm_class, tmp_path):
    from minivllm import LLM

    file, arch, cls_name, hf_name, config_name, overrides, pooling = EMBED_CASES[case]
    registered_vllm_class(file, arch, cls_name)
    path = _checkpoint(tmp_path, config_name, hf_name, overrides)
    hf = getattr(transformers, hf_name).from_pretrained(path).eval()
    llm = LLM(model=path, dtype="float32", runner="pooling",
              pooler_config=pooling and {"pooling_type": pooling})
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    for out, ids in zip(outputs, PROMPTS):
        torch.testing.assert_close(torch.as_tensor(out.outputs.embedding),
                                   _reference_embedding(hf, ids, pooling or "CLS"),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(CLASSIFY_CASES))
def test_vllm_encoder_file_classifier_logits_match_transformers(case, registered_vllm_class,
                                                                tmp_path):
    from minivllm import LLM

    file, arch, config_name, overrides = CLASSIFY_CASES[case]
    registered_vllm_class(file, arch, None)
    path = _checkpoint(tmp_path, config_name, arch, dict(overrides, num_labels=3))
    hf = getattr(transformers, arch).from_pretrained(path).eval()
    # No pooler_config: each class's own default (CLS for BERT / RoBERTa; ModernBERT's head
    # follows the HF config's `classifier_pooling`).
    llm = LLM(model=path, dtype="float32", runner="pooling")
    outputs = llm.encode([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    for out, ids in zip(outputs, PROMPTS):
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0]            # [num_labels]
        torch.testing.assert_close(torch.as_tensor(out.outputs.data), expected,
                                   rtol=1e-4, atol=1e-4)


def test_vllm_lfm2_file_generates_as_transformers(registered_vllm_class, tmp_path):
    """lfm2.py imports the pooler package (for its bidirectional embedding class) beside the
    causal LM; the LM's short-convolution and attention layers decode as transformers does.
    vLLM's file reads `conv_dim` / `block_dim`, which LiquidAI's config.json files carry and
    transformers' Lfm2Config keeps as extra fields."""
    from tests.model_executor.models.test_lfm2 import TINY_LFM2

    registered_vllm_class("lfm2", "Lfm2ForCausalLM", None)
    path = write_tiny_checkpoint(tmp_path, transformers.Lfm2Config, transformers.Lfm2ForCausalLM,
                                 **TINY_LFM2, conv_dim=64, block_dim=64)
    assert_matches_transformers(path, prompts=make_prompts(1000, (5, 17, 33)), num_tokens=12)


def test_vllm_bert_file_prefills_whole_prompts_under_a_small_budget(registered_vllm_class,
                                                                    tmp_path):
    """BERT pools CLS by default, so (as vLLM's `attn_type`) it attends bidirectionally: a
    16-token budget still runs each 50-token prompt in one step, never in chunks."""
    from minivllm import LLM

    registered_vllm_class("bert", "BertModel", "BertEmbeddingModel")
    path = _checkpoint(tmp_path, "BertConfig", "BertModel", {})
    hf = transformers.BertModel.from_pretrained(path).eval()
    llm = LLM(model=path, dtype="float32", runner="pooling", max_num_batched_tokens=16,
              pooler_config={"pooling_type": "MEAN"})
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    for out, ids in zip(outputs, PROMPTS):
        torch.testing.assert_close(torch.as_tensor(out.outputs.embedding),
                                   _reference_embedding(hf, ids, "MEAN"), rtol=1e-4, atol=1e-4)


def test_vllm_colbert_file_token_embeddings_match_a_projected_bert(registered_vllm_class,
                                                                   tmp_path):
    """colbert.py's ColBERTModel (an HF_ColBERT checkpoint: `bert.*` plus a bias-free `linear`
    projection): each token's embedding is BERT's hidden state projected to 32 dims and
    L2-normalised (the token_embed task, ALL pooling)."""
    import json

    from safetensors.torch import load_file, save_file

    from minivllm import LLM

    registered_vllm_class("colbert", "HF_ColBERT", "ColBERTModel")
    path = _checkpoint(tmp_path, "BertConfig", "BertModel", {})
    hf = transformers.BertModel.from_pretrained(path).eval()
    linear = 0.1 * torch.randn(32, 64, generator=torch.Generator().manual_seed(1))   # [D, H]
    weights = {f"bert.{name}": t for name, t in load_file(f"{path}/model.safetensors").items()
               if not name.startswith("pooler.")}
    save_file(dict(weights, **{"linear.weight": linear}), f"{path}/model.safetensors",
              metadata={"format": "pt"})
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    with open(f"{path}/config.json", "w") as f:
        json.dump(dict(config, architectures=["HF_ColBERT"]), f)
    llm = LLM(model=path, dtype="float32", runner="pooling", pooler_config={"pooling_type": "ALL"})
    outputs = llm.encode([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    for out, ids in zip(outputs, PROMPTS):
        with torch.no_grad():
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]          # [n, H]
        torch.testing.assert_close(torch.as_tensor(out.outputs.data),
                                   F.normalize(hidden @ linear.T, dim=-1), rtol=1e-4, atol=1e-4)
