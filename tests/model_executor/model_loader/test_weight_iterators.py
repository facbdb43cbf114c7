"""Checkpoint readers: safetensors (single file and sharded index), pytorch_model.bin, GGUF."""

import os

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minivllm.model_executor.model_loader.weight_iterators import (gguf_weights_iterator,
                                                                   safetensors_weights_iterator)


@pytest.fixture(scope="module")
def tiny_state_dict():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float().eval()
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kwargs,index", [({}, "model.safetensors"),
                                          ({"max_shard_size": "50KB"}, "model.safetensors.index.json")])
def test_folder_iterator_yields_the_state_dict(tmp_path, tiny_state_dict, kwargs, index):
    model, state = tiny_state_dict
    model.save_pretrained(tmp_path, **kwargs)
    assert os.path.isfile(tmp_path / index)
    if "max_shard_size" in kwargs:
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    yielded = dict(safetensors_weights_iterator(str(tmp_path)))
    assert yielded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(yielded[name], tensor), name


def test_pytorch_bin_fallback(tmp_path, tiny_state_dict):
    # transformers 5 writes only safetensors, so the legacy file is written by hand.
    _, state = tiny_state_dict
    torch.save(state, tmp_path / "pytorch_model.bin")
    yielded = dict(safetensors_weights_iterator(str(tmp_path)))
    assert yielded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(yielded[name], tensor), name


def test_empty_folder_raises(tmp_path):
    with pytest.raises(ValueError, match="No model.safetensors"):
        list(safetensors_weights_iterator(str(tmp_path)))


@pytest.fixture(scope="module")
def smollm2(hf_default_model, default_model_path):
    """(our weights, transformers' state dict) for the embedded SmolLM2 GGUF, built once."""
    reference = {k: v.detach() for k, v in hf_default_model.state_dict().items()}
    ours = dict(gguf_weights_iterator(default_model_path, hf_default_model.config))
    return ours, reference, hf_default_model.config


def test_gguf_names_and_shapes_match_transformers(smollm2):
    ours, reference, config = smollm2
    expected = set(reference)
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == reference[name].shape, name


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                  "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                                  "model.layers.7.self_attn.q_proj.weight", "model.embed_tokens.weight",
                                  "model.norm.weight"])
def test_gguf_values_match_transformers(smollm2, name):
    ours, reference, _ = smollm2
    assert (ours[name] - reference[name].float()).abs().max().item() <= 1e-6


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf does to q/k rows (HF halves -> interleaved pairs).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_types_names_and_unpermute_on_a_synthetic_file(tmp_path, arch):
    import gguf

    rng = np.random.default_rng(0)
    hf_q = rng.standard_normal((8, 32)).astype(np.float32)     # 2 heads x head_dim 4, [out, in]
    hf_k = rng.standard_normal((4, 32)).astype(np.float32)     # 1 KV head
    embed = rng.standard_normal((6, 32)).astype(np.float32)
    down = rng.standard_normal((32, 64)).astype(np.float32)
    permute = _llama_cpp_permute if arch == "llama" else (lambda w, n: w)
    k_q8 = gguf.quants.quantize(permute(hf_k, 1), gguf.GGMLQuantizationType.Q8_0)
    down_q4 = gguf.quants.quantize(down, gguf.GGMLQuantizationType.Q4_1)
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", embed.astype(np.float16))
    writer.add_tensor("blk.0.attn_q.weight", permute(hf_q, 2))
    writer.add_tensor("blk.0.attn_k.weight", k_q8, raw_shape=k_q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_down.weight", down_q4, raw_shape=down_q4.shape,
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("rope_freqs.weight", np.ones(2, dtype=np.float32))
    writer.add_tensor("blk.0.strange.weight", np.ones(3, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    config = LlamaConfig(num_attention_heads=2, num_key_value_heads=1, hidden_size=32)
    out = dict(gguf_weights_iterator(path, config))
    assert list(out) == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                         "model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight",
                         "blk.0.strange.weight"]   # unknown names pass through; rope_freqs is dropped
    assert all(t.dtype == torch.float32 for t in out.values())
    assert torch.allclose(out["model.embed_tokens.weight"], torch.from_numpy(embed), atol=1e-3)
    assert torch.equal(out["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(hf_q))
    assert torch.allclose(out["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(hf_k), atol=0.05)
    assert out["model.layers.0.mlp.down_proj.weight"].shape == (32, 64)
    assert torch.allclose(out["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(down), atol=0.5)
