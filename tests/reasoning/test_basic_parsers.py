"""`<think>` parsers: the split of whole outputs, streaming prefixes that never leak part of a tag
and only grow, where the prompt leaves the model, and the tokens they need."""

from __future__ import annotations

import pytest

from minivllm.reasoning import (DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
                                ReasoningParserManager, get_reasoning_parser)
from tests.entrypoints.openai._helpers import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    tok = make_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    return tok


@pytest.mark.parametrize("name, text, in_reasoning, split", [
    ("qwen3", "<think>\nwhy\n</think>\n\nanswer", False, ("\nwhy\n", "\n\nanswer")),
    ("qwen3", "plain answer", False, ("", "plain answer")),            # thinking off
    ("qwen3", "cut short <think", True, ("cut short <think", "")),      # opened by the prompt
    ("qwen3", "<think>never closed", False, ("never closed", "")),
    ("deepseek_r1", "why</think>answer", False, ("why", "answer")),     # R1's template opens it
    ("deepseek_r1", "<think>why</think>answer", False, ("why", "answer")),
    ("deepseek_r1", "still thinking", False, ("still thinking", "")),
])
def test_whole_output_split(tokenizer, name, text, in_reasoning, split):
    parser = get_reasoning_parser(name, tokenizer)
    start = in_reasoning or parser.starts_in_reasoning(())
    assert parser.parse(text, True, start) == split
    if not in_reasoning:   # vLLM's whole-output call (no prompt): None for an empty part
        assert parser.extract_reasoning(text) == tuple(x or None for x in split)


@pytest.mark.parametrize("name, text", [("qwen3", "<think>a </b> c</think> d </think"),
                                        ("qwen3", "<thin plain"),
                                        ("deepseek_r1", "x<</think>y")])
def test_stream_prefixes_grow_and_never_show_part_of_a_tag(tokenizer, name, text):
    parser = get_reasoning_parser(name, tokenizer)
    start = parser.starts_in_reasoning(())
    final = parser.parse(text, True, start)
    last = ("", "")
    for end in range(len(text) + 1):
        reasoning, content = parser.parse(text[:end], False, start)
        assert final[0].startswith(reasoning) and final[1].startswith(content), text[:end]
        assert reasoning.startswith(last[0]) and content.startswith(last[1])
        partial_tag = any(reasoning.endswith("</think>"[:k]) for k in range(1, 8))
        assert not partial_tag or reasoning == final[0], text[:end]
        last = (reasoning, content)


def test_where_the_prompt_leaves_the_model(tokenizer):
    qwen3 = Qwen3ReasoningParser(tokenizer)
    r1 = DeepSeekR1ReasoningParser(tokenizer)
    start, end = qwen3.reasoning_start_token_id, qwen3.reasoning_end_token_id
    assert not qwen3.starts_in_reasoning([5, 6]) and r1.starts_in_reasoning([5, 6])
    assert qwen3.starts_in_reasoning([5, start, 7]) and r1.starts_in_reasoning([5, start])
    closed = [5, start, 9, end, 7]                     # enable_thinking: false
    assert not qwen3.starts_in_reasoning(closed) and not r1.starts_in_reasoning(closed)
    assert qwen3.is_reasoning_end(closed) and not qwen3.is_reasoning_end([5, start, 9])
    assert not qwen3.is_reasoning_end([end, 3, start])
    assert qwen3.extract_content_ids(closed) == [7] and qwen3.extract_content_ids([5]) == []


def test_a_vocabulary_without_the_tags_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="needs <think> and </think> as tokens"):
        get_reasoning_parser("qwen3", make_tokenizer())
    with pytest.raises(ValueError, match="choose one of deepseek_r1, qwen3"):
        ReasoningParserManager.get_reasoning_parser("nope")
