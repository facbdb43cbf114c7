"""Checkpoint readers: each yields `(hf_name, tensor)` pairs in HF layout, one tensor at a time."""

import glob
import json
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from minivllm.logger import init_logger
from minivllm.transformers_utils.gguf_file import open_gguf

if TYPE_CHECKING:     # transformers costs ~1 s to import; GGUF runs skip it
    from transformers import PretrainedConfig

logger = init_logger(__name__)

Weights = Iterator[tuple[str, torch.Tensor]]

# llama.cpp tensor names -> HF Llama names (`blk.N.` becomes `model.layers.N.`).
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                      "output": "lm_head",
                      "token_embd_norm": "model.embedding_norm"}     # LFM2's final norm
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Gemma 2/3 keep four norms per block; llama.cpp's `ffn_norm` is their pre-MLP one.
_GGUF_GEMMA2_BLOCK_NAMES = {**_GGUF_BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm",
                            "ffn_norm": "pre_feedforward_layernorm",
                            "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's q/k/v and gate/up matrices are fused in the file as in its HF checkpoints.
_GGUF_PHI3_BLOCK_NAMES = {**_GGUF_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj",
                          "ffn_up": "mlp.gate_up_proj"}
# MoE blocks: the router (ffn_gate_inp) and three stacked expert tensors [E, rows, cols], split
# into the family's per-expert HF names ("{}": the expert). Mixtral is llama.cpp's "llama".
_GGUF_MIXTRAL_BLOCK_NAMES = {**_GGUF_BLOCK_NAMES, "ffn_gate_inp": "block_sparse_moe.gate",
                             **{f"ffn_{p}_exps": f"block_sparse_moe.experts.{{}}.{w}"
                                for p, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))}}
_GGUF_QWEN_MOE_BLOCK_NAMES = {**_GGUF_BLOCK_NAMES, "ffn_gate_inp": "mlp.gate",
                              **{f"ffn_{p}_exps": f"mlp.experts.{{}}.{p}_proj"
                                 for p in ("gate", "up", "down")}}
# Qwen2-MoE adds a shared expert (an MLP) and its sigmoid gate (one row, stored 1-D).
_GGUF_QWEN2_MOE_BLOCK_NAMES = {**_GGUF_QWEN_MOE_BLOCK_NAMES,
                               "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                               **{f"ffn_{p}_shexp": f"mlp.shared_expert.{p}_proj"
                                  for p in ("gate", "up", "down")}}
# DeepSeek-V2/V3 (MLA + routed and shared experts). Newer converters split kv_b_proj into
# attn_k_b [nH, L, Dn] (each head's W_UK transposed) and attn_v_b [nH, Dv, L]:
# `merge_mla_kv_b` joins them back. exp_probs_b is V3's correction bias (a whole name).
_GGUF_DEEPSEEK2_BLOCK_NAMES = {
    **_GGUF_QWEN_MOE_BLOCK_NAMES, "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj", "exp_probs_b": "mlp.gate.e_score_correction_bias",
    **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")}}
_GGUF_WHOLE_NAMES = ("mlp.gate.e_score_correction_bias",)
# LFM2: pre-norms named operator_norm / ffn_norm, the short-conv mixer, w1 / w3 / w2 MLPs.
_GGUF_LFM2_BLOCK_NAMES = {
    **_GGUF_BLOCK_NAMES, "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
    "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm", "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
    "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2"}
_GGUF_ARCH_BLOCK_NAMES = {"gemma2": _GGUF_GEMMA2_BLOCK_NAMES, "gemma3": _GGUF_GEMMA2_BLOCK_NAMES,
                          "phi3": _GGUF_PHI3_BLOCK_NAMES, "llama": _GGUF_MIXTRAL_BLOCK_NAMES,
                          "qwen3moe": _GGUF_QWEN_MOE_BLOCK_NAMES,
                          "qwen2moe": _GGUF_QWEN2_MOE_BLOCK_NAMES,
                          "deepseek2": _GGUF_DEEPSEEK2_BLOCK_NAMES,
                          "lfm2": _GGUF_LFM2_BLOCK_NAMES}
# Archs whose converter stored every RMSNorm weight as `1 + w` (Gemma's norms add the 1 back).
_GGUF_NORM_SHIFT_ARCHS = ("gemma", "gemma2", "gemma3")
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([\w.]+)\.(weight|bias)$")   # LFM2: shortconv.conv
# Tensors llama.cpp stores that the HF model recomputes (Llama-3 RoPE frequency factors) or
# that the config carries (Phi-3's LongRoPE factors).
_GGUF_UNUSED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Architectures whose converter permuted Q/K rows for GPT-J-style RoPE (undone below).
_GGUF_PERMUTED_ARCHS = ("llama",)


def safetensors_weights_iterator(folder: str) -> Weights:
    """Every tensor of a HF folder: `model.safetensors`, a sharded index, or `pytorch_model*.bin`."""
    files = _checkpoint_files(folder, "model.safetensors.index.json", "*.safetensors")
    if files:
        from safetensors import safe_open

        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    files = _checkpoint_files(folder, "pytorch_model.bin.index.json", "pytorch_model*.bin")
    if not files:
        raise ValueError(f"No model.safetensors, *.safetensors or pytorch_model*.bin in {folder!r}")
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()
        del state


def gguf_weights_iterator(path: str, hf_config: "PretrainedConfig") -> Weights:
    """Dequantise every GGUF tensor to fp32 and yield it under its HF Llama name, `[out, in]`.

    llama.cpp permuted the Q and K rows of Llama checkpoints (GPT-J RoPE pairing); the rows are
    put back in HF order, as transformers' own GGUF loader does.
    """
    import gguf

    def dequantised() -> Weights:
        for tensor, name, shape, unpermute in gguf_tensors(path, hf_config):
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            weight = unpermute(torch.from_numpy(data.reshape(shape).copy()).float())
            yield from split_experts(name, weight)
    yield from merge_mla_kv_b(dequantised())


def merge_mla_kv_b(weights: Weights, packed: bool = False) -> Weights:
    """Newer llama.cpp DeepSeek files: each layer's `k_b_proj` [nH, L, Dn] and `v_b_proj`
    [nH, Dv, L] (dequantised) joined back into `kv_b_proj.weight` [nH*(Dn+Dv), L], per head
    W_UK's Dn rows then W_UV's Dv; with `packed`, as an F32 `kv_b_proj.qweight` (the GGUF
    methods' float form). Every other weight passes through."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, weight in weights:
        for kind in ("k_b_proj", "v_b_proj"):
            if name.endswith(f".self_attn.{kind}.weight"):
                prefix = name[: -len(f"{kind}.weight")]
                held = parts.setdefault(prefix, {})
                held[kind] = weight
                break
        else:
            yield name, weight
            continue
        if len(held) == 2:
            del parts[prefix]
            k_b, v_b = held["k_b_proj"], held["v_b_proj"]
            kv_b = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])
            if packed:
                kv_b = kv_b.contiguous()
                kv_b.gguf_type = 0                                 # GGML F32
                yield prefix + "kv_b_proj.qweight", kv_b
            else:
                yield prefix + "kv_b_proj.weight", kv_b.contiguous()
    for prefix, held in parts.items():      # a half without its other half: report it
        for kind, weight in held.items():
            yield f"{prefix}{kind}.weight", weight


def split_experts(name: str, tensor: torch.Tensor) -> Weights:
    """A stacked expert tensor `[E, rows, cols]` (its name holds "{}") as E per-expert weights
    (views); any other tensor as it is."""
    if "{}" not in name:
        yield name, tensor
        return
    for expert in range(tensor.shape[0]):
        yield name.format(expert), tensor[expert]


def gguf_tensors(path: str, hf_config: "PretrainedConfig") -> Iterator[tuple]:
    """`(tensor info, HF name, HF shape, row fix)` of each used tensor of a .gguf file; `row fix`
    puts llama.cpp's per-head Q/K row order back, or Gemma's norm offsets (identity otherwise)."""
    gguf_file = open_gguf(path)    # parsed once per process, shared with the config and tokenizer
    arch = gguf_file.architecture
    text_config = hf_config.get_text_config()
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    for tensor in gguf_file.tensors:
        if tensor.name in _GGUF_UNUSED:
            continue
        name = _gguf_to_hf_name(tensor.name, _GGUF_ARCH_BLOCK_NAMES.get(arch, _GGUF_BLOCK_NAMES))
        # GGUF lists dims fastest-first, so the HF shape is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])               # llama.cpp's 1-D gate is the HF [1, H] row
        heads = None
        if arch in _GGUF_NORM_SHIFT_ARCHS and name.endswith("norm.weight"):
            yield tensor, name, shape, _minus_one
            continue
        if arch in _GGUF_PERMUTED_ARCHS and ".q_proj." in name:
            heads = num_heads
        elif arch in _GGUF_PERMUTED_ARCHS and ".k_proj." in name:
            heads = num_kv_heads
        yield tensor, name, shape, (lambda w: w) if heads is None else (
            lambda w, n=heads: _unpermute_rows(w, n))


def _gguf_to_hf_name(gguf_name: str, block_names: dict[str, str] = _GGUF_BLOCK_NAMES) -> str:
    base, _, kind = gguf_name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    match = _GGUF_BLOCK_RE.match(gguf_name)
    if match and match.group(2) in block_names:
        layer, part, kind = match.groups()
        if block_names[part] in _GGUF_WHOLE_NAMES:
            return f"model.layers.{layer}.{block_names[part]}"
        return f"model.layers.{layer}.{block_names[part]}.{kind}"
    # Unknown tensors pass through unchanged, so the loader lists them as unexpected.
    return gguf_name


def _minus_one(weight: torch.Tensor) -> torch.Tensor:
    return weight - 1


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order.

    llama.cpp stores each head's rows as `d/2` interleaved pairs; HF (NeoX RoPE) keeps the two
    halves apart, i.e. the row order is `(2, d/2)` instead of `(d/2, 2)`.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    # [heads, d/2, 2, ...] -> swap the pair axes -> [heads, 2, d/2, ...] -> original shape
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


def _checkpoint_files(folder: str, index_name: str, pattern: str) -> list[str]:
    index = os.path.join(folder, index_name)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    return sorted(glob.glob(os.path.join(folder, pattern)))
