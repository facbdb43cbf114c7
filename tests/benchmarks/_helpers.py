"""Benchmark-test fixtures: a tiny random Llama checkpoint with its own byte-level BPE tokenizer (no
downloads), a tiny random GGUF file, and a fake llama.cpp model."""

from tests.conftest import make_bpe_tokenizer, write_tiny_llama

_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is a tiny tokenizer",
           "paged attention and continuous batching", "0123456789 !?.,;:"] * 8


def write_tiny_checkpoint(folder: str) -> str:
    """tests.conftest's tiny Llama (vocab 1000) plus a ~300-token tokenizer; ids 0/1/2 = pad/bos/eos."""
    write_tiny_llama(folder)
    make_bpe_tokenizer(_CORPUS, 300).save_pretrained(folder)
    return folder


def write_tiny_gguf(path: str, *, untied: bool = False, seed: int = 0) -> str:
    """A random llama-arch GGUF with a little of everything the variant writer copies: scalar,
    string and array metadata, 2-D F32 and Q8_0 weights, a 1-D norm, and rows of 40 columns that
    no 32-element quant block divides (the writer's F16 fallback)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "a", "b"])
    writer.add_array("tokenizer.ggml.token_type", [3, 3, 1, 1])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", rng.standard_normal((16, 64)).astype(np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((32, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_down.weight", rng.standard_normal((64, 96)).astype(np.float32))
    writer.add_tensor("blk.0.attn_k.weight", rng.standard_normal((8, 40)).astype(np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    if untied:
        writer.add_tensor("output.weight", rng.standard_normal((16, 64)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class FakeLlama:
    """What time_llama_cpp drives (LlamaCppModel's methods): the next token is (last + 1) % vocab."""

    def __init__(self, vocab: int = 10) -> None:
        self.vocab = vocab
        self.context: list[int] = []
        self.evals: list[list[int]] = []

    def reset(self) -> None:
        self.context = []

    def eval(self, token_ids: list[int]) -> None:
        self.evals.append(list(token_ids))
        self.context += token_ids

    def greedy_token(self) -> int:
        return (self.context[-1] + 1) % self.vocab

    def close(self) -> None:
        pass
