"""GGUF files of LFM2 (llama.cpp's "lfm2") as llama.cpp's converter writes them: the conv layers
marked by a KV head count of 0 in the per-layer head_count_kv array, the MLP width stated
already adjusted, the short-conv kernel squeezed to [H, K] (`shortconv.conv`), the final norm as
`token_embd_norm`. Packed and dequantised, they give transformers' greedy tokens on the same
(Q8_0-rounded) weights."""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Lfm2Config, Lfm2ForCausalLM

from minivllm.model_executor.models.lfm2 import lfm2_intermediate_size
from minivllm.transformers_utils.config import get_config
from tests.conftest import make_bpe_tokenizer
from tests.model_executor.layers.quantization._gguf_helpers import (_add_metadata,
                                                                 assert_gguf_matches_hf, write_out)
from tests.model_executor.models._family_helpers import TINY_DENSE, write_tiny_checkpoint
from tests.model_executor.models.test_lfm2 import TINY_LFM2

pytestmark = pytest.mark.requires_native

_BLOCK = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.out_proj": "attn_output", "self_attn.q_layernorm": "attn_q_norm",
          "self_attn.k_layernorm": "attn_k_norm", "conv.conv": "shortconv.conv",
          "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj",
          "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up",
          "feed_forward.w2": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.embedding_norm.weight": "token_embd_norm.weight"}


def _q8_round_trip(w: np.ndarray) -> np.ndarray:
    import gguf

    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)


def write_lfm2_gguf(folder: str) -> tuple[str, str]:
    """(the .gguf file, a HF folder holding the same weights, linears Q8_0-rounded)."""
    import gguf

    tokenizer = make_bpe_tokenizer(["the capital of france is paris. " * 20], 300)
    # rope_theta: the file states _add_metadata's 10000 (LFM2's default is 1e6)
    config = {**TINY_DENSE, "vocab_size": len(tokenizer), **TINY_LFM2,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    hf_dir = write_tiny_checkpoint(os.path.join(folder, "hf"), Lfm2Config, Lfm2ForCausalLM,
                                   **config)
    file = os.path.join(hf_dir, "model.safetensors")
    state = {name: torch.from_numpy(_q8_round_trip(w.float().numpy())) if w.dim() == 2
             else w.float() for name, w in load_file(file).items()}
    save_file(state, file, metadata={"format": "pt"})
    path = os.path.join(folder, "tiny-lfm2.gguf")
    writer = gguf.GGUFWriter(path, "lfm2")
    _add_metadata(writer, {**config, "intermediate_size":
                           lfm2_intermediate_size(Lfm2Config(**config))}, tokenizer)
    writer.add_head_count_kv([config["num_key_value_heads"] if t == "full_attention" else 0
                              for t in config["layer_types"]])
    writer.add_shortconv_l_cache(3)
    writer.add_layer_norm_rms_eps(config["norm_eps"])
    for name, w in state.items():
        w = w.numpy()
        module = None
        if name in _GLOBAL:
            gguf_name = _GLOBAL[name]
        else:
            layer, rest = name.split(".")[2], name.split(".", 3)[3]
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_BLOCK[module]}.{kind}"
        if module == "conv.conv":
            w = np.ascontiguousarray(w.reshape(w.shape[0], -1))     # [H, 1, K] -> [H, K], F32
            writer.add_tensor(gguf_name, w)
        elif w.ndim == 2:
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, q, raw_shape=q.shape,
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, w)
    write_out(writer)
    return path, hf_dir


@pytest.fixture(scope="module")
def lfm2_gguf(tmp_path_factory):
    return write_lfm2_gguf(str(tmp_path_factory.mktemp("lfm2_gguf")))


@pytest.mark.parametrize("quantization", ["gguf", "none"], ids=["packed", "dequantised"])
def test_lfm2_gguf_matches_transformers(lfm2_gguf, quantization):
    assert_gguf_matches_hf(*lfm2_gguf, quantization)


def test_lfm2_gguf_config_states_the_layer_types(lfm2_gguf):
    config = get_config(lfm2_gguf[0])
    assert config.architectures == ["Lfm2ForCausalLM"]
    assert config.layer_types == TINY_LFM2["layer_types"]
    assert (config.num_key_value_heads, config.conv_L_cache) == (2, 3)
    assert config.norm_eps == pytest.approx(1e-5)
    assert lfm2_intermediate_size(config) == 64 and config.tie_word_embeddings
