"""Tiny GGUF files written with gguf's own writer: llama.cpp metadata, a byte-level BPE vocabulary."""

import numpy as np
import pytest

# A byte-level vocabulary: two control tokens, a user-defined one, one spelled as raw text
# (outside the byte alphabet: llama.cpp writes some that way) and merges that build "hello".
TOKENS = ["<|endoftext|>", "<|im_start|>", "h", "e", "l", "o", "Ġ", "he", "ll", "hell", "hello",
          "Ġh", "<think>", "raw text"]
TOKEN_TYPES = [3, 3] + [1] * 10 + [4, 1]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ h"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"


def write_tiny_gguf(path: str, arch: str = "llama", tied: bool = False,
                    tokenizer_model: str = "gpt2", pre: str = "default") -> str:
    """A 2-layer model's metadata and two F32 tensors (`output.weight` unless `tied`)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_embedding_length(32)
    writer.add_block_count(2)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(5e5)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(8)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(TOKENS), 32), np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.ones((len(TOKENS), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path):
    """`make(name="tiny", **write_tiny_gguf_kwargs) -> path` of a fresh file in tmp_path."""
    def make(name: str = "tiny", **kwargs) -> str:
        return write_tiny_gguf(str(tmp_path / f"{name}.gguf"), **kwargs)

    return make
