"""Benchmark datasets: `random` (as `vllm bench --dataset-name random`): token-id prompts for both backends."""

import argparse
import math
from dataclasses import dataclass

import numpy as np

DATASET_NAMES = ("random",)


@dataclass
class SampleRequest:
    """One benchmark request: the prompt as token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def add_dataset_args(parser: argparse.ArgumentParser, *, input_len: int = 136, output_len: int = 128,
                     num_prompts: int = 64, range_ratio: float = 0.88) -> None:
    """Dataset flags. The defaults are the issue's workload: 64 prompts of 16-256 tokens, 128 out."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASET_NAMES)
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=input_len,
                   help="mean prompt length in tokens")
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int,
                   default=output_len, help="tokens generated per request (eos is ignored)")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--random-range-ratio", type=float, default=range_ratio,
                   help="prompt lengths are uniform in [input_len*(1-r), input_len*(1+r)]; "
                        "output lengths stay exactly --output-len")


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive [low, high] of lengths drawn around `length` (low is at least 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    if length < 1:
        raise ValueError(f"lengths must be at least 1, got {length}")
    low = max(1, math.floor(length * (1 - range_ratio)))
    return low, max(low, math.ceil(length * (1 + range_ratio)))


def token_pool(tokenizer) -> np.ndarray:
    """Ids a random prompt may use: the tokenizer's whole vocabulary except its special tokens."""
    special = set(tokenizer.all_special_ids or [])
    # NOTE: chat markers such as <|im_start|> are added tokens flagged special but need not be
    # listed in all_special_ids; leave them out too.
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    vocab = np.arange(len(tokenizer), dtype=np.int64)
    pool = vocab[~np.isin(vocab, np.fromiter(special, dtype=np.int64, count=len(special)))]
    if pool.size == 0:
        raise ValueError("The tokenizer has no non-special tokens to build random prompts from.")
    return pool


def sample_random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """`num_prompts` prompts of random non-special token ids; a given seed gives the same prompts."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    if output_len < 1:
        raise ValueError(f"output_len must be at least 1, got {output_len}")
    low, high = length_range(input_len, range_ratio)
    rng = np.random.default_rng(seed)
    pool = token_pool(tokenizer)
    lengths = rng.integers(low, high + 1, size=num_prompts)
    tokens = rng.choice(pool, size=int(lengths.sum()))
    # Slice one flat draw into prompts: [num_prompts] variable-length lists.
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [SampleRequest(tokens[offsets[i]:offsets[i + 1]].tolist(), output_len)
            for i in range(num_prompts)]


def get_requests(args: argparse.Namespace, tokenizer, seed: int | None = None) -> list[SampleRequest]:
    """The requests the dataset flags describe (drawn with `seed`, default --seed)."""
    if args.dataset_name not in DATASET_NAMES:
        raise ValueError(f"Unknown dataset {args.dataset_name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if tokenizer is None:
        raise ValueError("The random dataset needs the model's tokenizer (for its vocabulary); "
                         "pass --tokenizer PATH.")
    return sample_random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                                  args.random_range_ratio, args.seed if seed is None else seed)
