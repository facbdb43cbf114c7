"""Tiny GGUF checkpoints for the quantized-path tests: a random HF Llama written as llama.cpp does.

The file carries what minivllm and transformers read from a GGUF: llama hyper-parameters, a
gpt2-style BPE tokenizer (trained here, no downloads), and every 2-D weight in the requested GGML
type (Q/K rows permuted the way llama.cpp's converter stores them); norms stay F32.
"""

import os

import numpy as np
import torch

from tests.conftest import TINY_LLAMA, make_bpe_tokenizer, write_tiny_llama

_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # HF halves -> llama.cpp's interleaved pairs, per head (what convert_hf_to_gguf does).
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.weight"


def _add_metadata(writer, config: dict, tokenizer) -> None:
    import gguf

    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    vocab = tokenizer.backend_tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = tokenizer.backend_tokenizer.to_str()
    import json
    merges = [" ".join(m) if isinstance(m, list) else m
              for m in json.loads(merges)["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<") and t.endswith(">")
                            else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)


def write_tiny_gguf(folder: str, qtype_name: str, seed: int = 0,
                    types: dict[str, str] | None = None, **overrides) -> str:
    """A tiny random Llama as `folder/tiny-<type>.gguf` (2-D weights in `qtype_name`, except
    those whose HF name ends with a key of `types`: that value's type, as llama.cpp's mixes)."""
    import gguf
    from safetensors.torch import load_file

    tokenizer = make_bpe_tokenizer(["the capital of france is paris. " * 20,
                                    "hello world, what is this?"], 512)
    # The vocabulary is what the trainer reached (a GGUF's vocab size is its token count).
    config = {**TINY_LLAMA, "vocab_size": len(tokenizer), **overrides}
    hf_dir = write_tiny_llama(os.path.join(folder, "hf"), seed=seed, **config)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    path = os.path.join(folder, f"tiny-{qtype_name}{'-mixed' if types else ''}.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    _add_metadata(writer, config, tokenizer)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            w = _permute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _permute(w, config["num_key_value_heads"])
        if w.ndim == 2:
            own = next((gguf.GGMLQuantizationType[t] for end, t in (types or {}).items()
                        if name.endswith(end)), qtype)
            q = gguf.quants.quantize(w, own)
            writer.add_tensor(_gguf_name(name), q, raw_shape=q.shape, raw_dtype=own)
        else:
            writer.add_tensor(_gguf_name(name), w)
    write_out(writer)
    return path


def hf_logits_of_gguf(path: str, token_ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [T, V] of a .gguf file (it dequantises every tensor)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def write_out(writer) -> None:
    """Header, metadata and tensors of a `gguf.GGUFWriter`, then close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_gguf_matches_hf(path: str, hf_dir: str, quantization: str) -> None:
    """The .gguf at `path` (packed or dequantised) gives transformers' greedy tokens on `hf_dir`
    (the same weights, dequantised) for two prompts."""
    from safetensors.torch import load_file

    from tests.model_executor.models._family_helpers import (assert_matches_transformers,
                                                             make_prompts)

    vocab = len(load_file(os.path.join(hf_dir, "model.safetensors"))["model.embed_tokens.weight"])
    assert_matches_transformers(path, prompts=make_prompts(vocab, (7, 33)), num_tokens=8,
                                reference=hf_dir, quantization=quantization)

