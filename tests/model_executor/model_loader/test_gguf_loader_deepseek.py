"""GGUF files of DeepSeek (llama.cpp's "deepseek2", also Kimi-K2 and GLM-4.7-Flash) as llama.cpp's
converter writes them: MLA's projections, kv_b_proj either whole (`attn_kv_b`, older files) or
split into `attn_k_b` [nH, L, Dn] and `attn_v_b` [nH, Dv, L] (newer ones, with the MQA view's
key/value lengths beside the `_mla` ones), the experts stacked `ffn_*_exps`, shared experts
`ffn_*_shexp`, V3's correction bias `exp_probs_b`, the routing and YaRN as metadata. Packed and
dequantised, they give transformers' greedy tokens on the same (Q8_0-rounded) weights."""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, \
    DeepseekV3ForCausalLM

from minivllm.transformers_utils.config import get_config
from tests.conftest import make_bpe_tokenizer
from tests.model_executor.layers.quantization._gguf_helpers import (_add_metadata,
                                                                 assert_gguf_matches_hf, write_out)
from tests.model_executor.models._family_helpers import TINY_DENSE, write_tiny_checkpoint

pytestmark = pytest.mark.requires_native

# Every quantized row a multiple of 32 values (Q8_0's block): Dn 32, L 32, q LoRA 32, nH*Dv 64.
_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=8, v_head_dim=16,
            num_key_value_heads=4, head_dim=None, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
         "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
         "rope_theta": 10000.0}
VARIANTS = {  # name -> (config class, model class, overrides, kv_b split in the file)
    # V2-Lite's shape (no query LoRA, greedy softmax routing), a newer converter's split kv_b.
    "v2_lite": (DeepseekV2Config, DeepseekV2ForCausalLM, {}, True),
    # V3's: query LoRA, sigmoid routing with the correction bias in 2 of 4 groups, YaRN.
    "v3": (DeepseekV3Config, DeepseekV3ForCausalLM,
           dict(q_lora_rank=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, rope_parameters=_YARN), False),
}
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
          "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
          "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
          "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          **{f"mlp.shared_experts.{p}_proj": f"ffn_{p}_shexp" for p in ("gate", "up", "down")}}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def _q8_round_trip(w: np.ndarray) -> np.ndarray:
    import gguf

    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)


def _round_split_kv_b(kv_b: torch.Tensor, config: dict) -> torch.Tensor:
    """kv_b_proj [nH*(Dn+Dv), L] rounded as the split file stores it: W_UK transposed
    ([nH, L, Dn], Q8_0 blocks along Dn) and W_UV ([nH, Dv, L], blocks along L)."""
    nope = config["qk_nope_head_dim"]
    w = kv_b.view(config["num_attention_heads"], nope + config["v_head_dim"], -1).numpy()
    k_b = _q8_round_trip(np.ascontiguousarray(w[:, :nope].transpose(0, 2, 1)))
    v_b = _q8_round_trip(np.ascontiguousarray(w[:, nope:]))
    return torch.from_numpy(np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1)
                            .reshape(kv_b.shape).copy())


def _llama_cpp_tensors(state: dict[str, torch.Tensor], config: dict,
                       split_kv_b: bool) -> dict[str, np.ndarray]:
    """The converter's tensors: renamed, experts stacked [E, rows, cols], kv_b split."""
    out, heads = {}, config["num_attention_heads"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        for part in ("gate", "up", "down"):
            names = [f"{prefix}.{e}.{part}_proj.weight" for e in range(config["n_routed_experts"])]
            if names[0] in state:
                out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack(
                    [state.pop(n).numpy() for n in names])
    for name, tensor in state.items():
        w = tensor.numpy()
        if name in _GLOBAL:
            out[_GLOBAL[name]] = w
            continue
        layer, rest = name.split(".")[2], name.split(".", 3)[3]
        if rest == "mlp.gate.e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = w
            continue
        module, kind = rest.rsplit(".", 1)
        if module == "self_attn.kv_b_proj" and split_kv_b:
            kv_b = w.reshape(heads, nope + v_dim, -1)
            out[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(
                kv_b[:, :nope].transpose(0, 2, 1))                       # [nH, L, Dn]
            out[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
            continue
        out[f"blk.{layer}.{_BLOCK[module]}.{kind}"] = w
    return out


def _add_deepseek_metadata(writer, config: dict, split_kv_b: bool) -> None:
    import gguf

    rope, latent = config["qk_rope_head_dim"], config["kv_lora_rank"]
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(latent)
    writer.add_rope_dimension_count(rope)
    if split_kv_b:   # newer converters: the MQA view as key / value length, per head as *_mla
        writer.add_key_length(latent + rope)
        writer.add_value_length(latent)
        writer.add_key_length_mla(config["qk_nope_head_dim"] + rope)
        writer.add_value_length_mla(config["v_head_dim"])
    else:
        writer.add_key_length(config["qk_nope_head_dim"] + rope)
        writer.add_value_length(config["v_head_dim"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_weights_scale(config.get("routed_scaling_factor", 1.0))
    writer.add_expert_weights_norm(config.get("norm_topk_prob", False))
    sigmoid = "q_lora_rank" in config           # the V3 variant
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
    if config.get("n_group"):
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
    yarn = config.get("rope_parameters")
    if yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn["factor"])
        writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * yarn["mscale_all_dim"])


def write_deepseek_gguf(folder: str, variant: str) -> tuple[str, str]:
    """(the Q8_0 .gguf file, a HF folder holding the same weights dequantised)."""
    import gguf

    config_cls, model_cls, extra, split_kv_b = VARIANTS[variant]
    tokenizer = make_bpe_tokenizer(["the capital of france is paris. " * 20], 300)
    config = {**TINY_DENSE, "vocab_size": len(tokenizer), **_MLA, **extra}
    make_config = config_cls if "q_lora_rank" in extra else (
        lambda **kw: config_cls(**kw, q_lora_rank=None))
    hf_dir = write_tiny_checkpoint(os.path.join(folder, "hf"), make_config, model_cls, **config)
    file = os.path.join(hf_dir, "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    state = {}
    for name, w in load_file(file).items():   # the reference: matrices Q8_0-rounded
        w = w.float()
        if name.endswith("e_score_correction_bias"):
            w = torch.randn(w.shape, generator=gen)              # a bias that steers the choice
        if name.endswith("kv_b_proj.weight") and split_kv_b:
            w = _round_split_kv_b(w, config)
        elif w.dim() == 2:
            w = torch.from_numpy(_q8_round_trip(w.numpy()))
        state[name] = w
    save_file(state, file, metadata={"format": "pt"})
    path = os.path.join(folder, f"tiny-deepseek-{variant}.gguf")
    writer = gguf.GGUFWriter(path, "deepseek2")
    _add_metadata(writer, config, tokenizer)
    _add_deepseek_metadata(writer, config, split_kv_b)
    for name, w in _llama_cpp_tensors(dict(state), config, split_kv_b).items():
        if w.ndim >= 2 and not name.endswith("ffn_gate_inp.weight"):
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            assert np.array_equal(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
                                  .reshape(w.shape), w)            # Q8_0 of Q8_0 is exact
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    write_out(writer)
    return path, hf_dir


@pytest.fixture(scope="module", params=list(VARIANTS))
def deepseek_gguf(request, tmp_path_factory):
    return (request.param, *write_deepseek_gguf(str(tmp_path_factory.mktemp(request.param)),
                                                request.param))


@pytest.mark.parametrize("quantization", ["gguf", "none"], ids=["packed", "dequantised"])
def test_deepseek_gguf_matches_transformers(deepseek_gguf, quantization):
    _, path, hf_dir = deepseek_gguf
    assert_gguf_matches_hf(path, hf_dir, quantization)


def test_deepseek_gguf_config_states_mla_and_routing(deepseek_gguf):
    variant, path, _ = deepseek_gguf
    config = get_config(path)
    assert config.architectures == ["DeepseekV2ForCausalLM"]
    assert (config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (32, 32, 8, 16)
    assert (config.n_routed_experts, config.n_shared_experts, config.first_k_dense_replace,
            config.moe_intermediate_size) == (4, 1, 1, 32)
    if variant == "v3":
        assert (config.q_lora_rank, config.scoring_func, config.topk_method) == (
            32, "sigmoid", "noaux_tc")
        assert (config.n_group, config.topk_group, config.routed_scaling_factor) == (2, 1, 2.5)
        assert config.rope_parameters["rope_type"] == "yarn"
        assert config.rope_parameters["mscale_all_dim"] == pytest.approx(0.707)
    else:
        assert (config.q_lora_rank, config.scoring_func, config.topk_method) == (
            None, "softmax", "greedy")
