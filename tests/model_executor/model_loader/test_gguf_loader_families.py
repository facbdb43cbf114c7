"""GGUF files of Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 and Phi-3, written as llama.cpp's converter
writes them (its tensor names, Gemma's norms stored as 1 + w, the metadata keys), run packed
(Q8_0 matrices) and dequantised, against transformers on the same dequantised weights."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          GemmaConfig, GemmaForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from tests.conftest import make_bpe_tokenizer
from tests.model_executor.layers.quantization._gguf_helpers import _add_metadata
from tests.model_executor.models._family_helpers import (TINY_DENSE, assert_matches_transformers,
                                                          make_prompts, write_tiny_checkpoint)

pytestmark = pytest.mark.requires_native
_GEMMA2 = dict(head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
               final_logit_softcapping=3.0, sliding_window=8)
FAMILIES = {   # GGUF arch -> (config class, model class, config overrides)
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32)),
    "gemma": (GemmaConfig, GemmaForCausalLM, dict(head_dim=32)),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, _GEMMA2),
    # The global base is the file's rope.freq_base (10000 here), the local one llama.cpp's 10000.
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                         for t in ("sliding_attention", "full_attention")})),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(sliding_window=8)),
}
_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
          "mlp.gate_up_proj": "ffn_up"}
_GEMMA2_BLOCK = {**_BLOCK, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf_name: str, arch: str) -> str:
    module, _, kind = hf_name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{kind}"
    _, _, layer, part = module.split(".", 3)
    table = _GEMMA2_BLOCK if arch in ("gemma2", "gemma3") else _BLOCK
    return f"blk.{layer}.{table[part]}.{kind}"


def _add_family_metadata(writer, arch: str, config: dict) -> None:
    if "head_dim" in config:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if "sliding_window" in config:
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma3":   # one flag per layer, True = local (sliding)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])


def write_family_gguf(folder: str, arch: str) -> tuple[str, str]:
    """(the .gguf file, an HF folder holding the same weights dequantised) for one family."""
    import gguf

    config_cls, model_cls, extra = FAMILIES[arch]
    tokenizer = make_bpe_tokenizer(["the capital of france is paris. " * 20], 300)
    config = {**TINY_DENSE, "vocab_size": len(tokenizer), **extra}
    hf_dir = write_tiny_checkpoint(os.path.join(folder, "hf"), config_cls, model_cls, **config)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    path = os.path.join(folder, f"tiny-{arch}.gguf")
    writer = gguf.GGUFWriter(path, arch)
    _add_metadata(writer, config, tokenizer)
    _add_family_metadata(writer, arch, config)
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if w.ndim == 2:        # matrices in Q8_0; the reference gets them back dequantised
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(_gguf_name(name, arch), q, raw_shape=q.shape,
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            state[name] = torch.from_numpy(
                gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape))
        else:                  # llama.cpp stores Gemma's norm weights as 1 + w
            shift = 1.0 if arch.startswith("gemma") and name.endswith("norm.weight") else 0.0
            writer.add_tensor(_gguf_name(name, arch), w + shift)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(state, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    return path, hf_dir


@pytest.mark.parametrize("quantization", ["gguf", "none"], ids=["packed", "dequantised"])
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_gguf_matches_transformers(tmp_path, arch, quantization):
    path, hf_dir = write_family_gguf(str(tmp_path), arch)
    vocab = len(load_file(os.path.join(hf_dir, "model.safetensors"))["model.embed_tokens.weight"])
    assert_matches_transformers(path, prompts=make_prompts(vocab, (7, 33)), num_tokens=8,
                                reference=hf_dir, quantization=quantization)


def test_gguf_configs_state_the_family_fields(tmp_path):
    from minivllm.transformers_utils.config import get_config

    path, _ = write_family_gguf(str(tmp_path), "gemma2")
    config = get_config(path)
    assert config.architectures == ["Gemma2ForCausalLM"]
    assert (config.head_dim, config.query_pre_attn_scalar, config.sliding_window) == (16, 16, 8)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (2.0, 3.0)


def test_phi3_longrope_factors_come_from_the_file(tmp_path):
    import gguf
    import numpy as np

    from minivllm.transformers_utils.config import get_config

    path = str(tmp_path / "phi3.gguf")
    writer = gguf.GGUFWriter(path, "phi3")
    _add_metadata(writer, dict(TINY_DENSE, max_position_embeddings=512),
                  make_bpe_tokenizer(["hello world"], 280))
    writer.add_rope_scaling_orig_ctx_len(64)
    writer.add_tensor("rope_factors_long.weight", np.linspace(1, 4, 8, dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.ones(8, np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    rope = get_config(path).rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 64
    assert rope["long_factor"] == pytest.approx(np.linspace(1, 4, 8).tolist())
    assert rope["short_factor"] == [1.0] * 8


def test_gemma2_27b_scales_queries_by_hidden_over_heads():
    from minivllm.transformers_utils.config import _gemma_gguf_fields

    fields = dict(num_hidden_layers=46, hidden_size=4608, num_attention_heads=32, head_dim=128)
    _gemma_gguf_fields({}, "gemma2", fields)
    assert fields["query_pre_attn_scalar"] == 144       # llama.cpp's 27B rule, not head_dim
    fields = dict(num_hidden_layers=42, hidden_size=3584, num_attention_heads=16, head_dim=256)
    _gemma_gguf_fields({}, "gemma2", fields)
    assert fields["query_pre_attn_scalar"] == 256
