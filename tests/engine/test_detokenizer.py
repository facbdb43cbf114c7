"""IncrementalDetokenizer over a tiny byte-level BPE (conftest's `tokenizer`, no downloads)."""

import pytest

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.sampling_params import SamplingParams

TEXTS = ["Hello world, the quick brown fox jumps over the lazy dog.",
         "Café crème brûlée 中文字符 🙂 emoji", "stop here STOP now"]


def stream(tokenizer, text, prompt="Hello", **params):
    """Feeds the tokens of `text` one by one; returns (detokenizer, deltas, stop string)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), SamplingParams(**params))
    deltas, stop = [], None
    for token_id in tokenizer.encode(text):
        stop = detok.update([token_id])
        deltas.append(detok.get_delta_text(finished=stop is not None))
        if stop is not None:
            break
    if stop is None:
        deltas.append(detok.get_delta_text(finished=True))
    return detok, deltas, stop


@pytest.mark.parametrize("text", TEXTS + ["中文 🙂🙂 brûlée<|endoftext|> the end"])
def test_incremental_text_equals_full_decode(tokenizer, text):
    detok, deltas, _ = stream(tokenizer, text)
    full = tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True)
    assert detok.output_text == full and "".join(deltas) == full
    assert not any("\ufffd" in d for d in deltas)   # split UTF-8 characters are held back


def test_special_tokens_kept_when_not_skipped(tokenizer):
    detok, _, _ = stream(tokenizer, "hi<|endoftext|>", skip_special_tokens=False)
    assert detok.output_text == "hi<|endoftext|>"


@pytest.mark.parametrize("include, expected", [(False, "Hello world, the "),
                                               (True, "Hello world, the quick")])
def test_stop_string_truncates(tokenizer, include, expected):
    detok, deltas, stop = stream(tokenizer, TEXTS[0], stop=["quick", "zzz"],
                                 include_stop_str_in_output=include)
    assert stop == "quick" and detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.update(tokenizer.encode(" more")) == "quick" and detok.output_text == expected


def test_earliest_stop_string_wins(tokenizer):
    detok, _, stop = stream(tokenizer, "the lazy dog.", stop=["dog", "lazy dog"])
    assert stop == "lazy dog" and detok.output_text == "the "


def test_possible_stop_prefix_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"]))
    final = "stop here STOP now"
    held_once = False
    for token_id in tokenizer.encode(final):
        assert detok.update([token_id]) is None
        visible = detok.get_output_text()
        assert final.startswith(visible)
        assert not any(visible.endswith("STOP!"[:k]) for k in range(1, 5))
        held_once |= len(visible) < len(detok.output_text)
    assert held_once and detok.get_output_text(finished=True) == final


def test_stop_strings_wait_for_min_tokens(tokenizer):
    # Matches in text produced before min_tokens are ignored for good (as in vLLM).
    first = tokenizer.encode("the quick")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["the"], min_tokens=len(first)))
    assert [detok.update([t]) for t in first] == [None] * len(first)
    assert detok.update(tokenizer.encode(" the")) == "the"
    assert detok.output_text == "the quick "
