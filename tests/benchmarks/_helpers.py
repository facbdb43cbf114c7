"""A tiny random Llama checkpoint with a tiny byte-level BPE tokenizer in the same folder (no downloads)."""

from tests.conftest import make_bpe_tokenizer, write_tiny_llama

_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny tokenizer",
           "paged attention and continuous batching", "0123456789 !?.,;:"] * 8


def write_tiny_checkpoint(folder: str) -> str:
    """tests.conftest's tiny Llama (vocab 1000) plus a ~300-token tokenizer; ids 0/1/2 = pad/bos/eos."""
    write_tiny_llama(folder)
    make_bpe_tokenizer(_CORPUS, 300).save_pretrained(folder)
    return folder
