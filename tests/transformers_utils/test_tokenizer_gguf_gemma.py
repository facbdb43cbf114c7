"""Gemma 1 GGUF files carry a sentencepiece vocabulary (tokenizer.ggml.model "llama", no merges).
transformers' AutoTokenizer refuses them (it reads the config first and has no "gemma" GGUF
config), while its Gemma converter handles the vocabulary: the same vocabulary in a "gemma2"
file, which AutoTokenizer takes, is the reference."""

import os

import numpy as np
import pytest

from minivllm.transformers_utils.tokenizer import get_tokenizer

# A Gemma-style vocabulary: specials, byte fallbacks, then pieces in merge order (Gemma's
# converter rebuilds the merges from the file's order), runs of spaces stored as real spaces.
_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_PIECES = ["\u2581", "t", "h", "e", "c", "a", "p", "i", "l", "o", "f", "r", "n", "s", "he",
           "\u2581t", "\u2581the", "\u2581c", "ap", "\u2581cap", "it", "al", "\u2581capital",
           "\u2581o", "\u2581of", "\u2581f", "ra", "nc", "\u2581fra", "\u2581france", "is",
           "\u2581is", "\u2581p", "ar", "\u2581par", "\u2581paris", "  ", "   "]
TEXTS = ["the capital of france is paris", "  the   france", "<start_of_turn>the cap<end_of_turn>",
         "unseen words: xyz"]


def _write(path: str, arch: str) -> str:
    import gguf

    tokens = _SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + _PIECES
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(_PIECES)   # control, unknown, byte, normal
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    fields = dict(block_count=1, embedding_length=64, head_count=4, tokenizer_model="llama",
                  token_list=tokens, token_scores=[0.0] * len(tokens), token_types=types,
                  bos_token_id=2, eos_token_id=1, unk_token_id=3, pad_token_id=0,
                  add_bos_token=True)
    for field, value in fields.items():           # writer.add_<field>(value)
        getattr(writer, f"add_{field}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gemma_gguf_sentencepiece_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    gemma = _write(str(tmp_path / "gemma.gguf"), "gemma")
    os.makedirs(tmp_path / "ref")
    gemma2 = _write(str(tmp_path / "ref" / "gemma2.gguf"), "gemma2")
    with pytest.raises(ValueError, match="gemma is not supported"):   # what we work around
        AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gemma.gguf")
    ours = get_tokenizer(gemma)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gemma2), gguf_file="gemma2.gguf")
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids,
                                                                        skip_special_tokens=True)
    assert ours("the")["input_ids"][0] == 2                  # add_bos_token from the file
    assert (ours.bos_token, ours.eos_token) == ("<bos>", "<eos>")
