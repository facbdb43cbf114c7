"""The random dataset: length ranges, vocabulary, seeds, and fresh prompts per round."""

import pytest

from minivllm.benchmarks.datasets import get_requests, length_range, sample_random_requests, token_pool
from minivllm.entrypoints.cli import build_parser


def test_length_range():
    assert length_range(136, 0.88) == (16, 256)
    assert length_range(10, 0.0) == (10, 10)
    assert length_range(1, 0.99) == (1, 2)
    with pytest.raises(ValueError, match="random_range_ratio"):
        length_range(10, 1.0)


def test_random_dataset_lengths_vocab_and_seed(tokenizer):
    reqs = sample_random_requests(tokenizer, 200, 20, 5, range_ratio=0.5, seed=3)
    lengths = [r.prompt_len for r in reqs]
    assert min(lengths) >= 10 and max(lengths) <= 30 and len(set(lengths)) > 5
    assert all(r.expected_output_len == 5 for r in reqs)
    ids = {t for r in reqs for t in r.prompt_token_ids}
    assert not ids & set(tokenizer.all_special_ids) and max(ids) < len(tokenizer)
    again = sample_random_requests(tokenizer, 200, 20, 5, range_ratio=0.5, seed=3)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    other = sample_random_requests(tokenizer, 200, 20, 5, range_ratio=0.5, seed=4)
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in reqs]


def test_token_pool_drops_added_special_tokens(tokenizer):
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    marker = tokenizer.convert_tokens_to_ids("<|im_start|>")
    pool = set(token_pool(tokenizer).tolist())
    assert marker not in pool and 0 not in pool and 5 in pool


def test_rounds_draw_fresh_prompts(tokenizer):
    args = build_parser().parse_args(["bench", "throughput", "--num-prompts", "4", "--seed", "5"])
    first, again = get_requests(args, tokenizer), get_requests(args, tokenizer, seed=5)
    assert [r.prompt_token_ids for r in first] == [r.prompt_token_ids for r in again]
    assert [r.prompt_token_ids for r in get_requests(args, tokenizer, seed=6)] != \
        [r.prompt_token_ids for r in first]
