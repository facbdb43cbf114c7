"""`bench moe --gguf-type`: the benchmark's random Qwen3-MoE checkpoint written as a GGUF file.

The file is what llama.cpp's converter plus `llama-quantize` make of a Qwen3-MoE model (arch
"qwen3moe"): llama.cpp's tensor names, each layer's experts stacked into `ffn_{gate,up,down}_exps`
[E, rows, cols], every matrix (experts, attention, embedding, LM head) in the chosen legacy type
(gguf-py's quantizer) or llama.cpp's K-quant mix (its quantizer, from an F16 file; needs
llama-cpp-python), the router and the norms in F32. Its vocabulary is synthetic (the 256
byte-level symbols, three control tokens, then filler tokens, one merge): the benchmark feeds
token ids, so only the vocabulary's size matters, and both minivllm and llama.cpp load it.
"""

import os

import gguf
import numpy as np
import torch

from minivllm.transformers_utils.tokenizer import gpt2_byte_alphabet

# HF module (inside model.layers.N.) -> llama.cpp tensor (inside blk.N.).
_BLOCK_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                "mlp.gate": "ffn_gate_inp"}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_UNQUANTIZED = ("_norm.weight", "ffn_gate_inp.weight")     # kept in F32, as llama-quantize does
_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def synthetic_vocabulary(size: int) -> list[str]:
    """`size` distinct byte-level tokens: the 256 symbols, the control tokens, fillers."""
    if size < 257 + len(_CONTROL):
        raise ValueError(f"--vocab-size must be at least {257 + len(_CONTROL)} for --gguf-type")
    # "to" first: the one merge ("t o"; an empty merge list is dropped from the file's metadata).
    fillers = ["to", *(f"tok{i}" for i in range(size - 257 - len(_CONTROL)))]
    symbols = gpt2_byte_alphabet()
    return [*(symbols[b] for b in range(256)), *_CONTROL, *fillers]


def _gguf_tensors(state: dict[str, torch.Tensor], num_layers: int,
                  num_experts: int) -> dict[str, np.ndarray]:
    """llama.cpp's fp32 tensors of a Qwen3-MoE state dict (experts stacked per layer)."""
    out = {gguf_name: state[hf_name].float().numpy()
           for hf_name, gguf_name in _GLOBAL_NAMES.items()}
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        for hf, name in _BLOCK_NAMES.items():
            out[f"blk.{layer}.{name}.weight"] = state[f"{prefix}{hf}.weight"].float().numpy()
        for proj in ("gate", "up", "down"):
            out[f"blk.{layer}.ffn_{proj}_exps.weight"] = torch.stack(
                [state[f"{prefix}mlp.experts.{e}.{proj}_proj.weight"]
                 for e in range(num_experts)]).float().numpy()
    return out


def write_moe_gguf(config, state: dict[str, torch.Tensor], path: str, type_name: str) -> str:
    """Write `state` (a Qwen3-MoE's HF tensors for `config`) to `path` as a GGUF whose matrices
    are `type_name`: a legacy type (F16, Q4_0 ... Q8_0) through gguf-py, or a K-quant mix
    (Q4_K_M, ...) through llama.cpp's quantizer from an F16 file; returns `path`."""
    from minivllm.benchmarks.gguf_variants import (K_QUANT_TYPES, LEGACY_TYPES, VARIANT_TYPES,
                                                   llama_cpp_quantize)

    if type_name in K_QUANT_TYPES:
        f16 = f"{path}.f16.gguf"
        try:
            _write_legacy(config, state, f16, *LEGACY_TYPES["F16"])
            return llama_cpp_quantize(f16, path, K_QUANT_TYPES[type_name])
        finally:
            if os.path.exists(f16):
                os.unlink(f16)
    if type_name not in LEGACY_TYPES:
        raise ValueError(f"--gguf-type {type_name!r}: choose one of {', '.join(VARIANT_TYPES)}")
    return _write_legacy(config, state, path, *LEGACY_TYPES[type_name])


def _write_legacy(config, state: dict[str, torch.Tensor], path: str, qtype, file_type) -> str:
    writer = gguf.GGUFWriter(path, "qwen3moe")
    _add_metadata(writer, config, file_type)
    for name, w in _gguf_tensors(state, config.num_hidden_layers, config.num_experts).items():
        if w.ndim >= 2 and not name.endswith(_UNQUANTIZED):
            q = gguf.quants.quantize(w, qtype)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_metadata(writer, config, file_type) -> None:
    writer.add_file_type(file_type)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta") or getattr(config, "rope_theta", 1e6)))
    tokens = synthetic_vocabulary(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in _CONTROL else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(["t o"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(256)


def load_state(folder: str) -> dict[str, torch.Tensor]:
    """The checkpoint `write_checkpoint` saved (one or more safetensors files)."""
    from safetensors.torch import load_file

    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, name)))
    return state
