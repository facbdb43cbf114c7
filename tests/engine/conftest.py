"""Shared by the engine tests: a tiny byte-level BPE tokenizer trained here (no downloads)."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# English, accented Latin, CJK and emoji: with 300 tokens, CJK and emoji split into byte tokens.
CORPUS = ["Hello world, the quick brown fox jumps over the lazy dog.",
          "Café crème brûlée 中文字符 🙂 emoji", "stop here STOP now", " Café 中文 🙂 ok"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
