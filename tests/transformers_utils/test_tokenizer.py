"""get_tokenizer on GGUF files: the tokenizer built from the metadata behaves as AutoTokenizer's."""

import json
import os

import pytest
from transformers import AutoTokenizer

from minivllm.transformers_utils.fast_tokenizer import FastTokenizer
from minivllm.transformers_utils.tokenizer import _BYTE_TO_CHAR, get_tokenizer

PROMPTS = ["What is the capital of France?", "", " leading and  double  spaces ", "line\nbreaks\r\n\ttabs",
           "Unicode: héllo wörld — 東京 🚀", "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>tail",
           "numbers 1234567 and code: def f(x): return x**2", "hello <think> raw text"]
CHAT = [[{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye 👋"}]]
SPECIAL_ATTRS = ["bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "unk_token_id", "pad_token_id", "special_tokens_map", "all_special_tokens",
                 "all_special_ids", "extra_special_tokens", "added_tokens_decoder", "chat_template",
                 "model_max_length", "padding_side", "truncation_side", "name_or_path", "vocab_size"]


def _reference(path: str):
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _assert_same_tokenizer(ours, ref) -> None:
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for attr in SPECIAL_ATTRS:
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab()
    for text in PROMPTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours(text, add_special_tokens=False).input_ids == ref(text, add_special_tokens=False).input_ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)


@pytest.fixture(scope="module")
def default_tokenizers(default_model_path):
    return get_tokenizer(default_model_path), _reference(default_model_path)


def test_default_model_tokenizer_equals_auto_tokenizer(default_tokenizers):
    ours, ref = default_tokenizers
    assert isinstance(ours, FastTokenizer)
    _assert_same_tokenizer(ours, ref)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert ours._hf_tokenizer is None         # all of it answered without transformers


@pytest.mark.parametrize("messages", CHAT)
def test_default_model_chat_template_equals_auto_tokenizer(default_tokenizers, messages):
    ours, ref = default_tokenizers
    for generation_prompt in (True, False):
        for tokenize in (False, True):
            kwargs = dict(tokenize=tokenize, add_generation_prompt=generation_prompt)
            out = ours.apply_chat_template(messages, **kwargs)
            assert out == ref.apply_chat_template(messages, **kwargs), kwargs
    text = ours.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>system\n")


def test_synthetic_vocabulary_equals_auto_tokenizer(tiny_gguf):
    # Control tokens, a user-defined token and a token spelled as raw text (respelled in bytes).
    path = tiny_gguf()
    ours = get_tokenizer(path)
    assert isinstance(ours, FastTokenizer)
    _assert_same_tokenizer(ours, _reference(path))
    assert ours.convert_ids_to_tokens(ours.encode("hello <think>")) == ["hello", "Ġ", "<think>"]
    assert ours.convert_tokens_to_ids("rawĠtext") == 13
    chat = ours.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert chat == "<|im_start|>hello"


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_other_pre_tokenizers_use_transformers_converter(tiny_gguf, pre):
    # A regex-split vocabulary is left to transformers, which knows each llama.cpp split.
    path = tiny_gguf(pre, pre=pre)
    ours = get_tokenizer(path)
    assert not isinstance(ours, FastTokenizer)
    _assert_same_tokenizer(ours, _reference(path))


def test_byte_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert _BYTE_TO_CHAR == bytes_to_unicode()
