"""Non-gated MoE experts (vLLM's `activation_without_mul`, Nemotron-H's relu2 experts): w13 holds
only the up rows, the activation maps [n, I] -> [n, I]; loaded per expert ("w1" / "w2") or all
experts at once (vLLM's full load of a fused checkpoint tensor)."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.layers.fused_moe import (FusedMoEFactory, activation_without_mul,
                                                      fused_experts, fused_topk)
from tests.model_executor.layers._helpers import layer_context

T, H, I, E, K = 19, 32, 24, 6, 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("name, expected", [("relu2", "relu2_no_mul"), ("silu", "silu_no_mul"),
                                            ("gelu_pytorch_tanh", "gelu_tanh_no_mul"),
                                            ("gelu_no_mul", "gelu_no_mul")])
def test_activation_without_mul_names(name, expected):
    assert activation_without_mul(name) == expected


def test_activation_without_a_non_gated_variant_is_refused():
    with pytest.raises(ValueError, match="no non-gated variant; choose one of"):
        activation_without_mul("swigluoai")


@pytest.mark.parametrize("activation, fn", [
    ("relu2_no_mul", lambda h: F.relu(h) ** 2), ("silu_no_mul", F.silu),
    ("gelu_tanh_no_mul", lambda h: F.gelu(h, approximate="tanh"))])
def test_non_gated_experts_match_per_token_loop(activation, fn):
    x = torch.randn(T, H, generator=_gen(1))
    w1, w2 = torch.randn(E, I, H, generator=_gen(2)) * 0.2, torch.randn(E, H, I, generator=_gen(3))
    weights, ids, _ = fused_topk(x, torch.randn(T, E, generator=_gen(4)), K, True)
    got = fused_experts(x, w1, w2, weights, ids, activation=activation)
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(ids[t, j])
            ref[t] += weights[t, j].double() * (fn(x[t].double() @ w1[e].double().T)
                                                @ w2[e].double().T)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def _runner():
    return FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                           ckpt_names=("up_proj", "down_proj", None), prefix="mixer.experts",
                           activation="relu2_no_mul")


def test_per_expert_and_full_loads_fill_the_up_rows():
    ups, downs = torch.randn(E, I, H, generator=_gen(5)), torch.randn(E, H, I, generator=_gen(6))
    with layer_context():
        per_expert, full = _runner(), _runner()
    experts = per_expert.routed_experts
    assert experts.w13_weight.shape == (E, I, H) and not experts.moe_config.is_act_and_mul
    state = {f"{e}.up_proj.weight": ups[e] for e in range(E)}
    state |= {f"{e}.down_proj.weight": downs[e] for e in range(E)}
    assert per_expert.load_weights(state.items()) == {"routed_experts.w13_weight",
                                                      "routed_experts.w2_weight"}
    assert torch.equal(experts.w13_weight, ups) and torch.equal(experts.w2_weight, downs)
    # All experts in one call: [E, I, H] from expert 0 on.
    target = full.routed_experts
    assert target.weight_loader(target.w13_weight, ups, "up_proj", "w1", 0, return_success=True)
    assert torch.equal(target.w13_weight, ups)
    with pytest.raises(ValueError, match="not 'w3'"):
        target.weight_loader(target.w13_weight, ups[0], "up_proj", "w3", 0)
