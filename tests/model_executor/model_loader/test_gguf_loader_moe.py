"""GGUF files of Mixtral (llama.cpp's "llama" with experts), Qwen3-MoE ("qwen3moe") and
Qwen2-MoE ("qwen2moe": q/k/v biases, a shared expert `ffn_*_shexp` with its 1-D sigmoid gate
`ffn_gate_inp_shexp`) as llama.cpp's converter writes them: each layer's router `ffn_gate_inp`
and its experts stacked in three 3-D tensors `ffn_{gate,up,down}_exps` [E, rows, cols], all in
Q8_0. Packed (the linears
and the experts keep their blocks, routers are dequantised at load) and dequantised, they give
transformers' greedy tokens on the same dequantised weights; packed bf16 decode steps replay as
CPU graphs; expert parallelism over packed experts equals one process, and a TP size that would
split an expert block is refused."""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from minivllm import LLM
from minivllm.model_executor.kernels import gguf_linear as gl
from tests._parallel_helpers import engine_kwargs, greedy_run
from tests.conftest import make_bpe_tokenizer
from tests.model_executor.layers.quantization._gguf_helpers import (_add_metadata, _permute,
                                                                 assert_gguf_matches_hf, write_out)
from tests.model_executor.models._family_helpers import (TINY_DENSE,
                                                          assert_cpu_graphs_replay_eager_steps,
                                                          make_prompts, write_tiny_checkpoint)

pytestmark = pytest.mark.requires_native

FAMILIES = {   # GGUF arch -> (config class, model class, overrides, MoE module, expert names)
    "mixtral": ("llama", MixtralConfig, MixtralForCausalLM,
                # rope_theta: the file states _add_metadata's 10000 (Mixtral's default is 1e6)
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                "block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
    "qwen3_moe": ("qwen3moe", Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       head_dim=32, norm_topk_prob=True),
                  "mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    # Qwen2 attention (q/k/v biases) + routed experts + a sigmoid-gated shared expert
    "qwen2_moe": ("qwen2moe", Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  dict(moe_intermediate_size=32, shared_expert_intermediate_size=64,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                  "mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
_DENSE = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _gguf_tensors(state: dict[str, torch.Tensor], config: dict, arch: str, moe: str,
                  experts: dict[str, str]) -> dict[str, np.ndarray]:
    """llama.cpp's tensors: dense ones renamed (Q/K rows permuted for "llama"), each layer's
    per-expert matrices stacked [E, rows, cols]."""
    out = {}
    num_experts = config.get("num_local_experts") or config["num_experts"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.{moe}"
        out[f"blk.{layer}.ffn_gate_inp.weight"] = state.pop(f"{prefix}.gate.weight").numpy()
        for part, hf in experts.items():
            out[f"blk.{layer}.ffn_{part}_exps.weight"] = np.stack(
                [state.pop(f"{prefix}.experts.{e}.{hf}.weight").numpy()
                 for e in range(num_experts)])
    for name, tensor in state.items():
        w = tensor.numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            w = _permute(w, heads)
        if name in _GLOBAL:
            out[_GLOBAL[name]] = w
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if module == "mlp.shared_expert_gate":
                w = w.reshape(-1)           # llama.cpp stores this one-row gate 1-D
            out[f"blk.{layer}.{_DENSE[module]}.{kind}"] = w
    return out


def write_moe_gguf(folder: str, family: str, **overrides) -> tuple[str, str]:
    """(the .gguf file, a HF folder with the same weights dequantised); `overrides` change the
    family's tiny config."""
    import gguf

    arch, config_cls, model_cls, extra, moe, experts = FAMILIES[family]
    tokenizer = make_bpe_tokenizer(["the capital of france is paris. " * 20], 300)
    config = {**TINY_DENSE, "vocab_size": len(tokenizer), **extra, **overrides}
    hf_dir = write_tiny_checkpoint(os.path.join(folder, "hf"), config_cls, model_cls, **config)
    state = {k: v.float() for k, v in load_file(os.path.join(hf_dir, "model.safetensors")).items()}
    path = os.path.join(folder, f"tiny-{family}.gguf")
    writer = gguf.GGUFWriter(path, arch)
    _add_metadata(writer, config, tokenizer)
    writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "qwen2moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    dequantised = {}
    for name, w in _gguf_tensors(dict(state), config, arch, moe, experts).items():
        if w.ndim >= 2:              # matrices and expert stacks in Q8_0
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            dequantised[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)
        else:
            writer.add_tensor(name, w)
    write_out(writer)
    # The reference: every quantized tensor back in its HF place, dequantised.
    reference = {}
    for name, w in _gguf_tensors(dict(state), config, arch, moe, experts).items():
        reference[name] = dequantised.get(name, w)
    save_file(_to_hf(reference, state, config, arch, moe, experts),
              os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    return path, hf_dir


def _to_hf(tensors: dict[str, np.ndarray], state: dict[str, torch.Tensor], config: dict,
           arch: str, moe: str, experts: dict[str, str]) -> dict[str, torch.Tensor]:
    """The HF state dict whose llama.cpp form is `tensors` (the inverse of `_gguf_tensors`)."""
    out = {}
    for name in state:
        if ".experts." in name or name.endswith(f"{moe}.gate.weight"):
            continue
        gguf_name = _GLOBAL.get(name)
        if gguf_name is None:
            module, kind = name.split(".", 3)[3].rsplit(".", 1)
            gguf_name = f"blk.{name.split('.')[2]}.{_DENSE[module]}.{kind}"
        w = tensors[gguf_name].reshape(state[name].shape)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            w = _unpermute(w, heads)
        out[name] = torch.from_numpy(np.ascontiguousarray(w)).float()
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.{moe}"
        out[f"{prefix}.gate.weight"] = torch.from_numpy(tensors[f"blk.{layer}.ffn_gate_inp.weight"])
        for part, hf in experts.items():
            stack = tensors[f"blk.{layer}.ffn_{part}_exps.weight"]
            for e in range(stack.shape[0]):
                out[f"{prefix}.experts.{e}.{hf}.weight"] = torch.from_numpy(stack[e].copy())
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe_gguf(request, tmp_path_factory):
    return (request.param, *write_moe_gguf(str(tmp_path_factory.mktemp(request.param)),
                                           request.param))


@pytest.mark.parametrize("quantization", ["gguf", "none"], ids=["packed", "dequantised"])
def test_moe_gguf_matches_transformers(moe_gguf, quantization):
    _, path, hf_dir = moe_gguf
    assert_gguf_matches_hf(path, hf_dir, quantization)


def test_moe_gguf_config_states_the_experts(moe_gguf):
    from minivllm.transformers_utils.config import get_config

    family, path, _ = moe_gguf
    config = get_config(path)
    if family == "mixtral":
        assert config.architectures == ["MixtralForCausalLM"]
        assert (config.num_local_experts, config.intermediate_size) == (4, 32)
    elif family == "qwen2_moe":
        assert config.architectures == ["Qwen2MoeForCausalLM"]
        assert (config.num_experts, config.moe_intermediate_size,
                config.shared_expert_intermediate_size) == (4, 32, 64)
        assert config.norm_topk_prob is False
    else:
        assert config.architectures == ["Qwen3MoeForCausalLM"]
        assert (config.num_experts, config.moe_intermediate_size, config.head_dim) == (4, 32, 32)
        assert config.norm_topk_prob is True
    assert config.num_experts_per_tok == 2


def _vocab(hf_dir: str) -> int:
    return len(load_file(os.path.join(hf_dir, "model.safetensors"))["model.embed_tokens.weight"])


def test_packed_experts_keep_the_files_blocks(moe_gguf):
    """Every MoE layer holds its experts as the file's Q8_0 bytes (gate rows, then up rows per
    expert), and no float copy of them."""
    import gguf

    _, path, _ = moe_gguf
    llm = LLM(model=path, dtype="bfloat16")
    model = llm.llm_engine.executor.worker.model_runner.model
    layers = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
    assert len(layers) == TINY_DENSE["num_hidden_layers"]
    reader = gguf.GGUFReader(path)
    stacks = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    for index, layer in enumerate(layers):
        assert {n for n, _ in layer.named_parameters()} == {"w13_qweight", "w2_qweight"}
        assert layer.w13_qweight.dtype == layer.w2_qweight.dtype == torch.uint8
        assert layer.w13_qweight_type == layer.w2_qweight_type == gguf.GGMLQuantizationType.Q8_0
        gate = stacks[f"blk.{index}.ffn_gate_exps.weight"]           # [E, I, row bytes]
        up = stacks[f"blk.{index}.ffn_up_exps.weight"]
        # the file's bytes (on AVX2 CPUs rearranged into the kernels' x8 layout: undone here)
        w13, w2 = (gl.gguf_unpack_x8(p.data.view(-1, p.shape[-1]), code).view(p.shape)
                   for p, code in ((layer.w13_qweight, layer.w13_qweight_kernel_type),
                                   (layer.w2_qweight, layer.w2_qweight_kernel_type)))
        assert torch.equal(w13, torch.cat([gate, up], dim=1))
        assert torch.equal(w2, stacks[f"blk.{index}.ffn_down_exps.weight"])


@pytest.mark.requires_native
def test_packed_bf16_decode_steps_replay_from_cpu_graphs(tmp_path):
    """The packed experts run in one native call per layer, so decode steps are recordable
    (16 experts: the router's bf16 GEMM needs 16 output rows to be native)."""
    path, hf_dir = write_moe_gguf(str(tmp_path), "qwen3_moe", num_experts=16)
    graphs = assert_cpu_graphs_replay_eager_steps(path, (6, 9), vocab_size=_vocab(hf_dir))
    assert sorted(graphs.entries) == [1, 2]


@pytest.mark.parametrize("moe_gguf", ["qwen3_moe"], indirect=True)
def test_expert_parallel_on_packed_experts_equals_one_process(moe_gguf):
    """Real gloo workers, each rank keeping the packed blocks of its 2 of the 4 experts."""
    _, path, hf_dir = moe_gguf
    prompts = make_prompts(_vocab(hf_dir), (7, 19))
    single = greedy_run(LLM(model=path, **engine_kwargs()), prompts)
    llm = LLM(model=path, **engine_kwargs(tensor_parallel_size=2, enable_expert_parallel=True))
    tokens, logprobs = greedy_run(llm, prompts)
    llm.shutdown()
    assert tokens == single[0]
    assert (logprobs - single[1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("moe_gguf", ["mixtral"], indirect=True)
def test_tp_that_splits_an_expert_block_is_refused(moe_gguf):
    """TP slices the experts' intermediate dimension (32 values, one Q8_0 block): TP=2 would
    split it, so it is refused, naming the sizes that work and expert parallelism."""
    _, path, _ = moe_gguf
    with pytest.raises(Exception, match=r"valid tensor_parallel_size values for this layer: "
                                        r"\[1\], or use --enable-expert-parallel"):
        LLM(model=path, **engine_kwargs(tensor_parallel_size=2))


@pytest.mark.parametrize("moe_gguf", ["mixtral"], indirect=True)
def test_compiled_packed_experts_are_one_opaque_op(moe_gguf):
    """--compile: the packed experts are the `gguf_fused_experts` op (no graph break) and the
    compiled model picks the eager model's greedy tokens."""
    from torch._dynamo.utils import counters

    from minivllm import SamplingParams

    _, path, hf_dir = moe_gguf
    prompt = make_prompts(_vocab(hf_dir), (9,))[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eager = LLM(model=path, dtype="bfloat16").generate([prompt], params, use_tqdm=False)
    counters.clear()
    compiled = LLM(model=path, dtype="bfloat16", enforce_eager=False)
    tokens = compiled.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens == eager[0].outputs[0].token_ids
    assert dict(counters["graph_break"]) == {}
