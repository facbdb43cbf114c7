"""vLLM 0.33.0's bailing_moe_linear.py (Ling / Ring 2.5, `BailingMoeV2_5ForCausalLM`) on
minivllm: lightning-attention layers (a per-sequence [heads, d, d] state with fixed per-head
decay) in groups with MLA layers, MoE MLPs with a shared expert and sigmoid group routing.

There is no transformers reference: transformers 5.25's `bailing_hybrid` is Ling 3.0 (Kimi
delta attention: a short conv, a per-channel learned forget gate and a delta-rule write with
beta; its MLA layers add a per-head output gate), a different architecture from Ling 2.5's
lightning attention. So the linear-attention layer is checked against a plain fp64
token-by-token run of its recurrence (projections, qk-norm, RoPE, gated group norm and all),
and the whole model against itself: greedy tokens and prompt logprobs of prompts scheduled
whole, in chunks of 8 beside other sequences' decodes, and after preemption must equal a
one-pass prefill of each final sequence alone (which has no state carried between steps).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, PretrainedConfig

from tests.model_executor.models._family_helpers import make_prompts, minivllm_greedy
from tests.model_executor.models._family_helpers import STATE_BUDGETS

ARCH = "BailingMoeV2_5ForCausalLM"
# 4 layers in groups of 2: linear, MLA, linear, MLA. 4 heads of 16 (state [4, 16, 16]); half
# of each linear head rotated; qk-norm; a gated norm over 2 groups; MLA with a q LoRA;
# 4 experts top-2 over 2 groups (sigmoid scores, a correction bias), a shared expert, and a
# dense MLP on layer 0.
TINY_BAILING = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    layer_group_size=2, num_attention_heads=4, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.5, use_qk_norm=True,
    group_norm_size=2, use_bias=False, use_qkv_bias=False, linear_silu=False,
    q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32,
    first_k_dense_replace=1, score_function="sigmoid", moe_router_enable_expert_bias=True,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    hidden_act="silu", tie_word_embeddings=False, architectures=[ARCH],
    bos_token_id=1, eos_token_id=2, pad_token_id=0)


class BailingMoeLinearConfig(PretrainedConfig):
    """Ling 2.5's checkpoints ship their config as remote code; the test's stand-in keeps
    every field as given."""

    model_type = "bailing_moe_linear"


def _register_config() -> None:
    try:
        AutoConfig.register("bailing_moe_linear", BailingMoeLinearConfig)
    except ValueError:                                   # already registered in this process
        pass


def _checkpoint_tensors(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights under Ling 2.5's checkpoint names (norms near 1)."""
    hidden, heads, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]

    def w(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.2 * torch.randn(n, generator=gen)

    t = {"model.word_embeddings.weight": w(cfg["vocab_size"], hidden, scale=0.5),
         "lm_head.weight": w(cfg["vocab_size"], hidden), "model.norm.weight": norm(hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        if (i + 1) % cfg["layer_group_size"]:                       # lightning attention
            t[p + "attention.query_key_value.weight"] = w(3 * heads * d, hidden)
            t[p + "attention.g_proj.weight"] = w(heads * d, hidden)
            t[p + "attention.dense.weight"] = w(hidden, heads * d)
            t[p + "attention.g_norm.weight"] = norm(heads * d)
            t[p + "attention.query_layernorm.weight"] = norm(d)
            t[p + "attention.key_layernorm.weight"] = norm(d)
        else:                                                       # MLA
            qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            t[p + "attention.q_a_proj.weight"] = w(cfg["q_lora_rank"], hidden)
            t[p + "attention.q_a_layernorm.weight"] = norm(cfg["q_lora_rank"])
            t[p + "attention.q_b_proj.weight"] = w(heads * qk, cfg["q_lora_rank"])
            t[p + "attention.kv_a_proj_with_mqa.weight"] = w(
                cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], hidden)
            t[p + "attention.kv_a_layernorm.weight"] = norm(cfg["kv_lora_rank"])
            t[p + "attention.kv_b_proj.weight"] = w(
                heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"])
            t[p + "attention.dense.weight"] = w(hidden, heads * cfg["v_head_dim"])
        t.update(_mlp_tensors(cfg, p, i, w))
    return t


def _mlp_tensors(cfg: dict, p: str, i: int, w) -> dict[str, torch.Tensor]:
    hidden = cfg["hidden_size"]

    def mlp(prefix: str, inter: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}gate_proj.weight": w(inter, hidden),
                f"{prefix}up_proj.weight": w(inter, hidden),
                f"{prefix}down_proj.weight": w(hidden, inter)}
    if i < cfg["first_k_dense_replace"]:
        return mlp(p + "mlp.", cfg["intermediate_size"])
    t = {p + "mlp.gate.weight": w(cfg["num_experts"], hidden, scale=0.5),
         p + "mlp.gate.expert_bias": w(cfg["num_experts"])}
    t.update(mlp(p + "mlp.shared_experts.",
                 cfg["moe_intermediate_size"] * cfg["num_shared_experts"]))
    for e in range(cfg["num_experts"]):
        t.update(mlp(f"{p}mlp.experts.{e}.", cfg["moe_intermediate_size"]))
    return t


def write_bailing_checkpoint(folder: Path, seed: int = 0, **overrides) -> str:
    cfg = {**TINY_BAILING, **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "config.json", "w") as f:
        json.dump({"model_type": "bailing_moe_linear", **cfg}, f)
    gen = torch.Generator().manual_seed(seed)
    save_file(_checkpoint_tensors(cfg, gen), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module")
def bailing_path(tmp_path_factory) -> str:
    _register_config()
    return write_bailing_checkpoint(tmp_path_factory.mktemp("bailing_linear"))


def _rope_neox_fp64(x: torch.Tensor, positions: torch.Tensor, rot: int, theta: float
                    ) -> torch.Tensor:
    """x [T, h, d]: the first `rot` channels rotated in two halves (neox style)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = positions.double()[:, None] * inv_freq                   # [T, rot/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2, rest = x[..., :rot // 2], x[..., rot // 2:rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _rms_fp64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def linear_layer_fp64(attn, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
    """Ling 2.5's lightning-attention layer written out plainly in fp64, one token at a time,
    from the layer's weights and the config (slopes from ALiBi's 2^(-8 i / h))."""
    cfg, (n, _) = TINY_BAILING, hidden.shape
    h, d, eps = cfg["num_attention_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    x = hidden.double()
    qkv = x @ attn.query_key_value.weight.double().T
    q, k, v = (t.view(n, h, d) for t in qkv.split(h * d, dim=-1))
    q = _rms_fp64(q, attn.query_layernorm.weight, eps)
    k = _rms_fp64(k, attn.key_layernorm.weight, eps)
    pos, rot = torch.arange(n), int(d * cfg["partial_rotary_factor"])
    q = _rope_neox_fp64(q, pos, rot, cfg["rope_theta"]) * d ** -0.5
    k = _rope_neox_fp64(k, pos, rot, cfg["rope_theta"])
    depth = 1 - layer_idx / (cfg["num_hidden_layers"] - 1) + 1e-5
    decay = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], dtype=torch.float64)
    decay = torch.exp(-decay * depth)[:, None, None]
    state, outs = torch.zeros(h, d, d, dtype=torch.float64), []
    for t in range(n):
        state = decay * state + k[t, :, :, None] * v[t, :, None, :]
        outs.append(torch.einsum("hd,hde->he", q[t], state).flatten())
    o = torch.stack(outs).view(n, cfg["group_norm_size"], -1)        # [T, groups, channels]
    o = _rms_fp64(o, torch.ones(1), eps).view(n, -1) * attn.g_norm.weight.double()
    o = o * torch.sigmoid(x @ attn.g_proj.weight.double().T)
    return o @ attn.dense.weight.double().T


def test_vllm_bailing_linear_layer_matches_fp64_recurrence(bailing_path, registered_vllm_class):
    from tests.model_executor.models._family_helpers import build_model

    cls = registered_vllm_class("bailing_moe_linear", ARCH, "BailingMoeV25ForCausalLM")
    model = build_model(bailing_path)
    assert type(model) is cls and model.is_hybrid
    kinds = [type(layer.self_attn).__name__ for layer in model.model.layers]
    assert kinds == ["BailingMoELinearAttention", "BailingMoeV25MLAAttention"] * 2
    hidden = torch.randn(77, TINY_BAILING["hidden_size"], generator=torch.Generator()
                         .manual_seed(2))
    for i in (0, 2):
        attn = model.model.layers[i].self_attn
        assert attn.kv_cache[0].shape[1:] == (4, 16, 16)               # [heads, d, d]
        out = torch.zeros_like(hidden)
        with torch.no_grad():   # a dummy-style run: one sequence from a zero state
            attn(hidden_states=hidden, output=out, positions=torch.arange(77))
        ref = linear_layer_fp64(attn, i, hidden)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        print(f"\nlayer {i}: max |out - fp64| / max |fp64| = {err:.2e}")
        assert err < 1e-5, f"layer {i}: relative error {err:.3g}"


PROMPTS = make_prompts(TINY_BAILING["vocab_size"], (5, 17, 70))
NUM_TOKENS = 12


def one_pass_reference(path: str, prompts: list[list[int]],
                       tokens: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """Per final sequence (prompt + generated), prefilled whole in one step: the top-1 token at
    every generated position and the logprob of every token after the first (float64)."""
    from minivllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=1024)
    seqs = [p + t for p, t in zip(prompts, tokens)]
    outs = llm.generate(seqs, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                        use_tqdm=False)
    refs = []
    for p, seq, out in zip(prompts, seqs, outs):
        steps = out.prompt_logprobs
        top1 = [max(steps[i], key=lambda t: steps[i][t].logprob)
                for i in range(len(p), len(seq))]
        refs.append((top1, torch.tensor([steps[i][seq[i]].logprob for i in range(1, len(seq))],
                                        dtype=torch.float64)))
    return refs


def assert_matches_one_pass(path: str, ours: list[tuple[list[int], torch.Tensor]],
                            prompts: list[list[int]], atol: float = 1e-4) -> None:
    """Greedy tokens are the one-pass run's top-1 choices, logprobs within `atol`."""
    ref = one_pass_reference(path, prompts, [t for t, _ in ours])
    for i, ((tokens, lp), (ref_tokens, ref_lp)) in enumerate(zip(ours, ref)):
        assert tokens == ref_tokens, f"prompt {i}: greedy tokens differ from the one-pass run"
        diff = (lp - ref_lp).abs().max().item()
        assert diff <= atol, f"prompt {i}: logprobs differ by {diff:.3g} (> {atol})"


@STATE_BUDGETS
def test_vllm_bailing_file_matches_one_pass_prefill(bailing_path, registered_vllm_class,
                                                    budget):
    """Prompts whole or in chunks of 8 beside the other sequences' decodes: the state carried
    across steps gives what one prefill of each final sequence gives."""
    from minivllm import LLM

    registered_vllm_class("bailing_moe_linear", ARCH, "BailingMoeV25ForCausalLM")
    llm = LLM(model=bailing_path, dtype="float32", block_size=4,
              max_num_batched_tokens=budget)
    ours = minivllm_greedy(llm, PROMPTS, NUM_TOKENS)
    assert_matches_one_pass(bailing_path, ours, PROMPTS)


@pytest.mark.slow      # ~20 s: 6 prompts of 24 tokens run out of blocks, then the reference
def test_vllm_bailing_preempted_sequences_restart_their_state(bailing_path,
                                                              registered_vllm_class):
    from minivllm import LLM

    registered_vllm_class("bailing_moe_linear", ARCH, "BailingMoeV25ForCausalLM")
    prompts = make_prompts(TINY_BAILING["vocab_size"], (17, 33, 40, 25, 50, 12))
    llm = LLM(model=bailing_path, dtype="float32", block_size=4, num_gpu_blocks_override=24,
              max_model_len=96)
    ours = minivllm_greedy(llm, prompts)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_matches_one_pass(bailing_path, ours, prompts)
