"""Shared by the engine tests: a tiny byte-level BPE tokenizer trained here (no downloads)."""

import pytest

from tests.conftest import make_bpe_tokenizer

# English, accented Latin, CJK and emoji: with 300 tokens, CJK and emoji split into byte tokens.
CORPUS = ["Hello world, the quick brown fox jumps over the lazy dog.",
          "Café crème brûlée 中文字符 🙂 emoji", "stop here STOP now", " Café 中文 🙂 ok"]


@pytest.fixture(scope="module")
def tokenizer():
    return make_bpe_tokenizer(CORPUS * 3, 300, special_tokens=("<|endoftext|>",))
