"""A tiny random Llama checkpoint with a tiny byte-level BPE tokenizer in the same folder (no downloads)."""

from tests.conftest import write_tiny_llama

_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny tokenizer",
           "paged attention and continuous batching", "0123456789 !?.,;:"] * 8


def write_tiny_checkpoint(folder: str) -> str:
    """tests.conftest's tiny Llama (vocab 1000) plus a ~300-token tokenizer; ids 0/1/2 = pad/bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    write_tiny_llama(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    return folder
