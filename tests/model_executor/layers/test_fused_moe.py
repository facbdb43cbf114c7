"""FusedMoE: routing (softmax / sigmoid, renormalise, correction bias, grouped top-k, scaling)
against a plain per-token reference, the sorted expert loop against a per-token loop, TP / EP
shards summing to the whole layer, and loading through `weight_loader` / `load_weights`."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.fused_moe import (FusedMoE, determine_expert_map,
                                                      fused_experts, fused_moe, fused_topk,
                                                      grouped_topk)
from minivllm.model_executor.models.auto_weights_loader import UnexpectedWeightsError
from tests.model_executor.layers._helpers import layer_context

T, H, I, E, K = 23, 64, 48, 8, 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ref_route(logits: torch.Tensor, k: int, renormalize: bool, scoring: str = "softmax",
               bias: torch.Tensor | None = None, groups: int = 0, topk_group: int = 0,
               scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time, with sorted Python lists: the routing rules written out."""
    weights, ids = [], []
    for row in logits.double():
        scores = row.softmax(-1) if scoring == "softmax" else row.sigmoid()
        choice = scores + (bias.double() if bias is not None else 0)
        allowed = list(range(len(row)))
        if groups:
            size = len(row) // groups
            def group_score(g):
                vals = sorted(choice[g * size:(g + 1) * size].tolist(), reverse=True)
                return vals[0] if bias is None else sum(vals[:2])
            best = sorted(range(groups), key=group_score, reverse=True)[:topk_group]
            allowed = [e for e in allowed if e // size in best]
        chosen = sorted(allowed, key=lambda e: choice[e].item(), reverse=True)[:k]
        w = scores[chosen]
        if renormalize:
            w = w / w.sum()
        weights.append(w * scale)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids)


def _same_routing(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]):
    (w, ids), (ref_w, ref_ids) = got, ref
    assert torch.equal(ids.long(), ref_ids)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_topk_matches_reference(scoring, renormalize):
    logits = torch.randn(T, E, generator=_gen(0))
    w, ids, rows = fused_topk(torch.empty(T, H), logits, K, renormalize, scoring_func=scoring)
    _same_routing((w, ids), _ref_route(logits, K, renormalize, scoring))
    assert rows[5, 1] == 1 * T + 5                 # k-major row of pair (token 5, slot 1)


def test_correction_bias_steers_choice_not_weights():
    logits = torch.randn(T, E, generator=_gen(1))
    bias = torch.randn(E, generator=_gen(2))
    w, ids, _ = fused_topk(torch.empty(T, H), logits, K, False, scoring_func="sigmoid",
                           e_score_correction_bias=bias)
    _same_routing((w, ids), _ref_route(logits, K, False, "sigmoid", bias))
    plain_ids = fused_topk(torch.empty(T, H), logits, K, False, scoring_func="sigmoid")[1]
    assert not torch.equal(ids, plain_ids)         # the bias changed some choices


@pytest.mark.parametrize("scoring, with_bias", [("softmax", False), ("sigmoid", True)])
def test_grouped_topk_matches_reference(scoring, with_bias):
    logits = torch.randn(T, E, generator=_gen(3))
    bias = torch.randn(E, generator=_gen(4)) if with_bias else None
    got = grouped_topk(torch.empty(T, H), logits, 3, True, num_expert_group=4, topk_group=2,
                       scoring_func=scoring, routed_scaling_factor=2.5,
                       e_score_correction_bias=bias)
    _same_routing(got, _ref_route(logits, 3, True, scoring, bias, groups=4, topk_group=2,
                                  scale=2.5))
    # Only experts of two groups (of 2 experts each) are ever chosen per token.
    assert all(len(set(groups)) <= 2 for groups in (got[1] // 2).tolist())


def test_grouped_topk_bad_groups_name_the_fields():
    with pytest.raises(ValueError, match="num_expert_group.*topk_group"):
        grouped_topk(torch.empty(2, H), torch.randn(2, E), 2, True, num_expert_group=3,
                     topk_group=1)


def test_unknown_scoring_function_lists_choices():
    with pytest.raises(ValueError, match="softmax, sigmoid"):
        fused_topk(torch.empty(2, H), torch.randn(2, E), 2, True, scoring_func="sparsemax")


def _weights(seed: int = 5, bias: bool = False):
    g = _gen(seed)
    w1, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    b1 = torch.randn(E, 2 * I, generator=g) * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if bias else None
    return w1, w2, b1, b2


def _ref_experts(x, w1, w2, weights, ids, activation="silu", b1=None, b2=None):
    """Per token, per chosen expert, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = x[t].double() @ w1[e].double().T + (b1[e].double() if b1 is not None else 0)
            # gpt-oss's layout (vLLM's "swigluoai") alternates gate and up rows.
            gate, up = (h[0::2], h[1::2]) if activation == "swigluoai" else (h[:I], h[I:])
            if activation == "silu":
                a = F.silu(gate) * up
            elif activation == "gelu_tanh":
                a = F.gelu(gate, approximate="tanh") * up
            else:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                a = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            y = a @ w2[e].double().T + (b2[e].double() if b2 is not None else 0)
            out[t] += weights[t, j].double() * y
    return out


@pytest.mark.parametrize("activation, bias", [("silu", False), ("swigluoai", True),
                                              ("swigluoai_uninterleave", True),
                                              ("gelu_tanh", False)])
def test_fused_experts_match_per_token_loop(activation, bias):
    x = torch.randn(T, H, generator=_gen(6))
    w1, w2, b1, b2 = _weights(bias=bias)
    weights, ids, _ = fused_topk(x, torch.randn(T, E, generator=_gen(7)), K, True)
    got = fused_experts(x, w1, w2, weights, ids, activation=activation, w1_bias=b1, w2_bias=b2)
    ref = _ref_experts(x, w1, w2, weights, ids, activation, b1, b2)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_expert_map_shards_sum_to_the_whole():
    """EP: each rank runs only its experts (contiguous runs); the sum equals all experts."""
    x = torch.randn(T, H, generator=_gen(8))
    w1, w2, _, _ = _weights()
    weights, ids, _ = fused_topk(x, torch.randn(T, E, generator=_gen(9)), K, False)
    whole = fused_experts(x, w1, w2, weights, ids)
    total = torch.zeros_like(whole)
    for rank in range(3):                          # 8 experts over 3 ranks: 3, 3, 2
        local, expert_map = determine_expert_map(3, rank, E)
        mine = (expert_map >= 0).nonzero().flatten()
        assert local == len(mine) == (3 if rank < 2 else 2)
        total += fused_experts(x, w1[mine], w2[mine], weights, ids, expert_map=expert_map)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6)


def test_router_weight_on_input_top1():
    x = torch.randn(T, H, generator=_gen(10)).abs()
    w1, w2, _, _ = _weights()
    weights, ids, _ = fused_topk(x, torch.randn(T, E, generator=_gen(11)), 1, False)
    got = fused_experts(x, w1, w2, weights, ids, apply_router_weight_on_input=True)
    ref = _ref_experts(x * weights, w1, w2, torch.ones_like(weights), ids)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def _checkpoint(seed: int = 12) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    state = {}
    for e in range(E):
        state[f"{e}.gate_proj.weight"] = torch.randn(I, H, generator=g) * 0.1
        state[f"{e}.up_proj.weight"] = torch.randn(I, H, generator=g) * 0.1
        state[f"{e}.down_proj.weight"] = torch.randn(H, I, generator=g) * 0.1
    return state


def _layer(**kwargs) -> FusedMoE:
    return FusedMoE(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                    renormalize=True, prefix="mlp.experts", **kwargs)


def test_load_weights_fills_w13_and_w2():
    state = _checkpoint()
    with layer_context():
        layer = _layer()
        loaded = layer.load_weights(state.items())
    assert loaded == {"w13_weight", "w2_weight"}
    assert torch.equal(layer.w13_weight[3], torch.cat([state["3.gate_proj.weight"],
                                                       state["3.up_proj.weight"]]))
    assert torch.equal(layer.w2_weight[5], state["5.down_proj.weight"])
    x, logits = torch.randn(T, H, generator=_gen(13)), torch.randn(T, E, generator=_gen(14))
    ref = fused_moe(x, layer.w13_weight, layer.w2_weight, logits, K, True)
    assert torch.equal(layer(x, logits), ref)


def test_missing_expert_is_not_reported_loaded_and_unknown_names_raise():
    state = _checkpoint()
    del state["2.up_proj.weight"]
    with layer_context():
        assert _layer().load_weights(state.items()) == {"w2_weight"}
        state["2.extra_proj.weight"] = torch.zeros(1)
        with pytest.raises(UnexpectedWeightsError, match="2.extra_proj.weight"):
            _layer().load_weights(state.items())


def test_tp_shards_sum_to_the_whole_layer():
    """TP=2 by hand: each rank holds I/2 of every expert; the partial outputs add up."""
    state = _checkpoint()
    x, logits = torch.randn(T, H, generator=_gen(15)), torch.randn(T, E, generator=_gen(16))
    with layer_context():
        whole = _layer()
        whole.load_weights(state.items())
        parts = []
        for rank in range(2):
            part = FusedMoE(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                            renormalize=True, tp_size=2, prefix="mlp.experts")
            part.tp_rank = rank                      # no process group here: set by hand
            assert part.w13_weight.shape == (E, I, H) and part.w2_weight.shape == (E, H, I // 2)
            part.load_weights(state.items())
            parts.append(fused_experts(x, part.w13_weight, part.w2_weight,
                                       *part.select_experts(x, logits)))
    torch.testing.assert_close(parts[0] + parts[1], whole(x, logits), rtol=1e-5, atol=1e-6)


def test_expert_params_mapping_names():
    mapping = FusedMoE.make_expert_params_mapping(None, "w1", "w2", "w3", num_experts=2)
    assert ("experts.w13_", "experts.1.w3.", 1, "w3") in mapping
    assert ("experts.w2_", "experts.0.w2.", 0, "w2") in mapping
    assert len(mapping) == 6
    # vLLM's older form without the model argument.
    assert FusedMoE.make_expert_params_mapping("w1", "w2", "w3", 2) == mapping


def test_unsupported_options_are_refused():
    with layer_context():
        with pytest.raises(NotImplementedError, match="EPLB"):
            _layer(enable_eplb=True)
        with pytest.raises(ValueError, match="relu_squared.*silu"):
            _layer(activation="relu_squared")
        with pytest.raises(ValueError, match=r"not divisible by tensor parallel size \(5\)"):
            _layer(tp_size=5)


@pytest.mark.requires_native
def test_bf16_amx_path_close_to_fp32():
    """bf16 experts (native AMX GEMMs for few rows, oneDNN for many) stay near the fp32 result;
    I = 64 so that both weights fit the AMX kernel's shape rules."""
    from minivllm import _custom_ops as ops

    g = _gen(19)
    w1, w2 = torch.randn(E, 128, H, generator=g) * 0.1, torch.randn(E, H, 64, generator=g) * 0.1
    assert ops.gemm_rows(w1[0].bfloat16()) == 0 or ops.gemm_rows(w2[0].bfloat16()) > 0
    for num_tokens in (1, 4, 300):
        x = torch.randn(num_tokens, H, generator=_gen(17))
        weights, ids, _ = fused_topk(x, torch.randn(num_tokens, E, generator=_gen(18)), K, True)
        ref = fused_experts(x, w1, w2, weights, ids)
        got = fused_experts(x.bfloat16(), w1.bfloat16(), w2.bfloat16(), weights, ids)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, rtol=0.05, atol=0.02)


def test_compiled_forward_calls_the_opaque_op_without_graph_breaks():
    """Under torch.compile the expert loop is the `minivllm::fused_experts` op (fullgraph)."""
    state = _checkpoint()
    x, logits = torch.randn(T, H, generator=_gen(20)), torch.randn(T, E, generator=_gen(21))
    with layer_context():
        layer = _layer()
        layer.load_weights(state.items())
    compiled = torch.compile(layer.forward_native, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, logits), layer(x, logits), rtol=0, atol=0)


def test_enable_expert_parallel_flag_reaches_the_parallel_config():
    import argparse

    from minivllm.engine.arg_utils import EngineArgs

    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--enable-expert-parallel", "-tp", "2"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.enable_expert_parallel and engine_args.tensor_parallel_size == 2


def test_linear_only_quant_config_leaves_experts_unquantized_and_says_so(monkeypatch):
    from unittest import mock

    from minivllm.model_executor.layers.fused_moe import routed_experts as layer_module
    from minivllm.model_executor.layers.quantization.fp8 import Fp8Config

    monkeypatch.setattr(layer_module, "_WARNED", set())
    with mock.patch.object(layer_module.logger, "warning") as warning, layer_context():
        first, second = _layer(quant_config=Fp8Config()), _layer(quant_config=Fp8Config())
    assert first.w13_weight.dtype == second.w2_weight.dtype == torch.float32
    warning.assert_called_once()                     # once per run, not once per layer
    assert "stay unquantized" in warning.call_args.args[0]


def test_vllm_style_loading_loop():
    """vLLM model files load experts with their own loop over `make_expert_params_mapping`:
    the mapped names are this layer's parameters and `weight_loader` reports success."""
    from torch import nn

    state = {f"experts.{k}": v for k, v in _checkpoint().items()}
    with layer_context():
        holder = nn.Module()
        holder.experts = _layer()
        reference = _layer()
    reference.load_weights(_checkpoint().items())
    mapping = FusedMoE.make_expert_params_mapping(holder, ckpt_gate_proj_name="gate_proj",
                                                  ckpt_down_proj_name="down_proj",
                                                  ckpt_up_proj_name="up_proj", num_experts=E)
    params = dict(holder.named_parameters())
    for name, tensor in state.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                mapped = name.replace(weight_name, param_name)
                param = params[mapped]
                assert param.weight_loader(param, tensor, mapped, shard_id=shard_id,
                                           expert_id=expert_id, return_success=True)
                break
    assert torch.equal(holder.experts.w13_weight, reference.w13_weight)
    assert torch.equal(holder.experts.w2_weight, reference.w2_weight)
