"""FastTokenizer: the engine's calls served by the backend alone, everything else by transformers."""

import copy
import os
import pickle

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from minivllm.transformers_utils.fast_tokenizer import FastTokenizer
from minivllm.transformers_utils.tokenizer import get_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]


@pytest.fixture
def pair(tiny_gguf):
    path = tiny_gguf()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return get_tokenizer(path), ref


def test_engine_calls_never_build_transformers_tokenizer(pair):
    ours, ref = pair
    ids = ours.encode("hello hello <think>")
    assert ids == ref.encode("hello hello <think>")
    assert ours.decode(ids) == ref.decode(ids) and ours.batch_decode([ids]) == ref.batch_decode([ids])
    tokens = ours.convert_ids_to_tokens(ids + [0], skip_special_tokens=True)
    assert tokens == ref.convert_ids_to_tokens(ids + [0], skip_special_tokens=True)
    assert ours.convert_tokens_to_string(tokens) == ref.convert_tokens_to_string(tokens)
    assert ours(["hello", "hell"]) == ref(["hello", "hell"])
    for array in (np.array(ids), torch.tensor(ids)):       # ids as arrays decode as lists do
        assert ours.decode(array) == ref.decode(array)
        assert ours.convert_ids_to_tokens(array) == ref.convert_ids_to_tokens(array)
    for kwargs in ({}, {"return_dict": False}, {"tokenize": False, "add_generation_prompt": True}):
        assert ours.apply_chat_template(CHAT, **kwargs) == ref.apply_chat_template(CHAT, **kwargs)
    assert ours.apply_chat_template([CHAT, CHAT[1:]], tokenize=False) == \
        ref.apply_chat_template([CHAT, CHAT[1:]], tokenize=False)
    assert ours._hf_tokenizer is None


def test_other_calls_go_to_transformers_on_the_same_backend(pair):
    ours, ref = pair
    assert ours.tokenize("hello hello") == ref.tokenize("hello hello")      # not defined here
    assert ours._hf_tokenizer is not None
    assert ours._hf_tokenizer.backend_tokenizer is ours.backend_tokenizer
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    template = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
    out = ours.apply_chat_template(CHAT, tools=tools, chat_template=template, tokenize=False)
    assert out == ref.apply_chat_template(CHAT, tools=tools, chat_template=template, tokenize=False)
    assert '"name": "f"' in out
    assert ours("hello", return_tensors="pt")["input_ids"].tolist() == [ref.encode("hello")]


def test_copies_and_pickles_keep_their_own_backend(pair):
    ours, _ = pair
    ours.tokenize("warm")                      # a transformers wrapper exists before the copy
    for clone in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert isinstance(clone, FastTokenizer) and clone._hf_tokenizer is None
        assert clone.backend_tokenizer is not ours.backend_tokenizer
        assert clone.encode("hello <think>") == ours.encode("hello <think>")
        assert clone.tokenize("hello") == ours.tokenize("hello")


def test_add_bos_eos_flags_set_the_post_processor(tiny_gguf):
    path = tiny_gguf()
    plain = get_tokenizer(path)
    both = FastTokenizer(copy.deepcopy(plain.backend_tokenizer), add_bos_token=True, add_eos_token=True,
                         bos_token="<|im_start|>", eos_token="<|endoftext|>")
    assert both.encode("hello") == [1, *plain.encode("hello"), 0]
    assert both.encode("hello", add_special_tokens=False) == plain.encode("hello")
    assert both._hf().encode("hello") == both.encode("hello")        # transformers agrees
    with pytest.raises(ValueError, match="valid: bos_token, eos_token, unk_token, pad_token"):
        FastTokenizer(plain.backend_tokenizer, cls_token="x")
