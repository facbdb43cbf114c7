"""What `LLM.score` and the server's /score and /rerank share: which kind of model scores, how
the two sides pair up, a cross-encoder's pair prompt, and the cosine of two embeddings."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def score_kind(model_config: Any) -> str:
    """"cross-encoder" (a classification model with one label: its probability is the score)
    or "embedding" (cosine similarity); ValueError for the other models."""
    task = getattr(model_config, "pooling_task", None)
    if task == "embed":
        return "embedding"
    num_labels = getattr(model_config.hf_config.get_text_config(), "num_labels", None) \
        if task == "classify" else None
    if num_labels == 1:
        return "cross-encoder"
    what = (f"a classification model with {num_labels} labels" if task == "classify"
            else "a text-generation model")
    raise ValueError(f"Scoring needs a cross-encoder (a sequence-classification model with one "
                     f"label) or an embedding model; this is {what}.")


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """1 to 1, 1 to N (the one text_1 against each text_2) or N to N pairs; ValueError naming
    the side at fault otherwise."""
    sides = []
    for name, value in (("text_1", text_1), ("text_2", text_2)):
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, (list, tuple)) or not texts or \
                not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name} must be a text or a non-empty list of texts.")
        sides.append(list(texts))
    first, second = sides
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 has {len(second)}: give one "
                         "text_1 (scored against each text_2) or as many as text_2.")
    return list(zip(first, second))


def cross_encoding_ids(tokenizer: Any, text_1: str, text_2: str) -> list[int]:
    """The pair as a cross-encoder reads it: the tokenizer's own pair encoding (its separator
    and special tokens, as the model was trained)."""
    return list(tokenizer(text=text_1, text_pair=text_2)["input_ids"])


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two embeddings `[H]`."""
    return float(F.cosine_similarity(a.float(), b.float(), dim=0))
