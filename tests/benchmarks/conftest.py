"""Shared by the benchmark tests: a tiny checkpoint with its own tokenizer."""

import pytest

from tests.benchmarks._helpers import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("bench_ckpt")))


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)
