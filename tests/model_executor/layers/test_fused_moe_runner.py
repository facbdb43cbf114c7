"""vLLM 0.33's MoE construction: `FusedMoEFactory` -> `MoERunner` (gate, router, `RoutedExperts`,
shared experts, the TP sum), its checkpoint layouts and `GateLinear`, against plain torch maths."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from minivllm.config import set_current_vllm_config
from minivllm.distributed import (destroy_distributed_environment, init_distributed_environment,
                                  initialize_model_parallel)
from minivllm.model_executor.layers.fused_moe import (FusedMoE, FusedMoEFactory, GateLinear,
                                                      MoERunner, RoutedExperts,
                                                      fused_moe_make_expert_params_mapping)
from minivllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from minivllm.model_executor.models.utils import AutoWeightsLoader
from tests.model_executor.layers._helpers import free_port, layer_context, make_vllm_config

E, K, H, I, T = 6, 2, 16, 24, 9


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _experts_state(names=("gate_proj", "down_proj", "up_proj")) -> dict[str, torch.Tensor]:
    gate, down, up = names
    g, state = _gen(0), {}
    for e in range(E):
        state[f"{e}.{gate}.weight"] = torch.randn(I, H, generator=g) * 0.2
        state[f"{e}.{up}.weight"] = torch.randn(I, H, generator=g) * 0.2
        state[f"{e}.{down}.weight"] = torch.randn(H, I, generator=g) * 0.2
    return state


def _reference(x: torch.Tensor, logits: torch.Tensor, state: dict, renormalize: bool = True,
               scale: float = 1.0) -> torch.Tensor:
    """Token by token: softmax, top-k, optional renormalisation, SiLU experts."""
    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(K, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)

    def w_(e: int, name: str) -> torch.Tensor:      # expert names, bare or under "experts."
        return state.get(f"{e}.{name}.weight", state.get(f"experts.{e}.{name}.weight"))
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h, u = x[t] @ w_(e, "gate_proj").T, x[t] @ w_(e, "up_proj").T
            out[t] += scale * w * ((torch.nn.functional.silu(h) * u) @ w_(e, "down_proj").T)
    return out


class _SharedMLP(nn.Module):
    """A TP-sharded shared expert whose down projection leaves the sum to the runner."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(H, [I] * 2, bias=False,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(I, H, bias=False, reduce_results=False,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)[0].chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)[0]


class _Block(nn.Module):
    """A vLLM 0.33-style MoE block: gate and shared expert registered before the runner."""

    def __init__(self, with_shared: bool = True, **factory_kwargs) -> None:
        super().__init__()
        self.gate = GateLinear(H, E, prefix="mlp.gate")
        self.shared_expert = _SharedMLP("mlp.shared_expert") if with_shared else None
        self.experts = FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H,
                                       intermediate_size=I, prefix="mlp.experts", gate=self.gate,
                                       shared_experts=self.shared_expert, **factory_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states=x, router_logits=x)     # the runner applies the gate


def _block_state(seed: int = 3) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    state = {f"experts.{k}": v for k, v in _experts_state().items()}
    state["gate.weight"] = torch.randn(E, H, generator=g)
    state["shared_expert.gate_up_proj.weight"] = torch.randn(2 * I, H, generator=g) * 0.2
    state["shared_expert.down_proj.weight"] = torch.randn(H, I, generator=g) * 0.2
    return state


def _shared_reference(x: torch.Tensor, state: dict) -> torch.Tensor:
    gate, up = (x @ state["shared_expert.gate_up_proj.weight"].T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ state["shared_expert.down_proj.weight"].T


def _load(block: nn.Module, state: dict) -> set[str]:
    return AutoWeightsLoader(block).load_weights(state.items())


def test_runner_holds_the_gate_and_adds_the_shared_expert():
    state = _block_state()
    with layer_context():
        block = _Block()
    loaded = _load(block, state)
    names = {n for n, _ in block.named_parameters()}
    # The gate and shared expert are reported once, under the block's own names.
    assert names == {"gate.weight", "shared_expert.gate_up_proj.weight",
                     "shared_expert.down_proj.weight", "experts.routed_experts.w13_weight",
                     "experts.routed_experts.w2_weight"}
    assert loaded == names
    assert isinstance(block.experts, MoERunner)
    x = torch.randn(T, H, generator=_gen(5))
    expected = _reference(x, x @ state["gate.weight"].T, state) + _shared_reference(x, state)
    torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)


def test_scaling_on_weights_or_on_the_output():
    """routed_scaling_factor scales the top-k weights; with apply_routed_scale_to_output it scales
    the routed sum instead, and either way the shared expert is not scaled."""
    state = _block_state()
    x = torch.randn(T, H, generator=_gen(6))
    logits = x @ state["gate.weight"].T
    expected = _reference(x, logits, state, scale=2.5) + _shared_reference(x, state)
    for on_output in (False, True):
        with layer_context():
            block = _Block(routed_scaling_factor=2.5, apply_routed_scale_to_output=on_output)
        _load(block, state)
        torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)


def test_runner_without_gate_takes_the_callers_logits():
    state = _experts_state()
    x, logits = torch.randn(T, H, generator=_gen(7)), torch.randn(T, E, generator=_gen(8))
    with layer_context():
        runner = FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                 renormalize=False, prefix="mlp.experts")
    assert runner.load_weights(state.items()) == {"routed_experts.w13_weight",
                                                  "routed_experts.w2_weight"}
    torch.testing.assert_close(runner(x, logits), _reference(x, logits, state, False),
                               rtol=1e-5, atol=1e-5)


def test_zero_experts_and_a_free_routing_bias():
    """LongCat-Flash's layout: logits and a correction bias over E real + 2 weightless identity
    experts; the bias is a Parameter of no module of the model's, loaded by the runner under
    "e_score_correction_bias". A chosen zero expert adds its weight times the input."""
    state, z, scale = _experts_state(), 2, 1.5
    x, logits = torch.randn(T, H, generator=_gen(7)), torch.randn(T, E + z, generator=_gen(8))
    bias = 0.05 * torch.randn(E + z, generator=_gen(9))     # softmax scores are ~1 / (E + z)
    with layer_context():
        runner = FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                 renormalize=False, prefix="mlp.experts",
                                 zero_expert_type="identity", routed_scaling_factor=scale,
                                 e_score_correction_bias=nn.Parameter(torch.zeros(E + z)))
    loaded = runner.load_weights([*state.items(), ("e_score_correction_bias", bias)])
    assert "routed_experts.e_score_correction_bias" in loaded
    probs = logits.softmax(-1)
    ids = (probs + bias).topk(K, dim=-1).indices
    expected = torch.zeros_like(x)
    for t in range(T):
        for e in ids[t].tolist():
            w = scale * probs[t, e]
            if e >= E:                                  # identity expert
                expected[t] += w * x[t]
            else:
                gate, up, down = (state[f"{e}.{n}.weight"] for n in ("gate_proj", "up_proj",
                                                                     "down_proj"))
                expected[t] += w * ((torch.nn.functional.silu(x[t] @ gate.T) * (x[t] @ up.T))
                                    @ down.T)
    assert (ids >= E).any() and (ids < E).any()
    torch.testing.assert_close(runner(x, logits), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_stacked_and_per_expert_fused_checkpoints(transposed):
    """transformers' stacked `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` (or [E, H, 2I] /
    [E, I, H] with is_fused_checkpoint_transposed), and per-expert `3.gate_up_proj.weight`, load
    the same parameters as separate per-expert tensors."""
    state = _experts_state()
    gate_up = torch.stack([torch.cat([state[f"{e}.gate_proj.weight"], state[f"{e}.up_proj.weight"]])
                           for e in range(E)])
    down = torch.stack([state[f"{e}.down_proj.weight"] for e in range(E)])
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    per_expert_fused = {f"{e}.gate_up_proj.weight": torch.cat(
        [state[f"{e}.gate_proj.weight"], state[f"{e}.up_proj.weight"]]) for e in range(E)}
    per_expert_fused |= {f"{e}.down_proj.weight": state[f"{e}.down_proj.weight"] for e in range(E)}
    with layer_context():
        kwargs = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, prefix="x")
        ref = RoutedExperts("x", None, num_experts=E, hidden_size=H, intermediate_size=I)
        stacked = FusedMoEFactory(is_fused_checkpoint_transposed=transposed, **kwargs)
        fused = FusedMoEFactory(**kwargs)
    ref.load_weights(state.items())
    assert stacked.load_weights([("gate_up_proj", gate_up), ("down_proj", down)]) == {
        "routed_experts.w13_weight", "routed_experts.w2_weight"}
    fused.load_weights(per_expert_fused.items())
    for runner in (stacked, fused):
        assert torch.equal(runner.routed_experts.w13_weight, ref.w13_weight)
        assert torch.equal(runner.routed_experts.w2_weight, ref.w2_weight)


def test_mixtral_names_and_the_model_level_mapping():
    """ckpt_names ("w1", "w2", "w3"); vLLM files that index named_parameters() themselves use
    fused_moe_make_expert_params_mapping, whose names are the runner's parameters."""
    state = _experts_state(("w1", "w2", "w3"))
    with layer_context():
        holder = nn.Module()
        holder.experts = FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H,
                                         intermediate_size=I, prefix="experts",
                                         ckpt_names=("w1", "w2", "w3"))
    params = dict(holder.named_parameters())
    mapping = fused_moe_make_expert_params_mapping(holder, "w1", "w2", "w3", E)
    for name, tensor in state.items():
        full = f"experts.{name}"
        param_name, weight_name, expert_id, shard_id = next(m for m in mapping if m[1] in full)
        param = params[full.replace(weight_name, param_name)]
        assert param.weight_loader(param, tensor, full, shard_id=shard_id, expert_id=expert_id,
                                   return_success=True)
    w13 = holder.experts.routed_experts.w13_weight
    assert torch.equal(w13[4], torch.cat([state["4.w1.weight"], state["4.w3.weight"]]))


def test_unknown_names_and_unsupported_features_are_named():
    from minivllm.model_executor.models.auto_weights_loader import UnexpectedWeightsError

    with layer_context():
        runner = FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
        with pytest.raises(UnexpectedWeightsError, match="3.extra_proj.weight"):
            runner.load_weights([("3.extra_proj.weight", torch.zeros(2, 2))])
        for bad, match in ((dict(enable_eplb=True), "EPLB"),
                           (dict(zero_expert_type="bogus"), "zero_expert_type"),
                           (dict(is_sequence_parallel=True), "sequence"),
                           (dict(activation="relu2"), "relu2")):
            with pytest.raises((NotImplementedError, ValueError), match=match):
                FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                **bad)


def test_gate_linear_out_dtype_and_fp32_compute():
    with layer_context():
        gate = GateLinear(H, E, params_dtype=torch.bfloat16, out_dtype=torch.float32)
        fp32 = GateLinear(H, E, params_dtype=torch.bfloat16, force_fp32_compute=True,
                          return_bias=False)
    assert gate.weight.dtype == torch.bfloat16 and fp32.weight.dtype == torch.float32
    x = torch.randn(T, H, generator=_gen(9)).bfloat16()
    logits, bias = gate(x)
    assert logits.dtype == torch.float32 and bias is None
    with torch.no_grad():
        fp32.weight.copy_(torch.randn(E, H, generator=_gen(10)))
    torch.testing.assert_close(fp32(x), x.float() @ fp32.weight.T)


def test_fused_moe_and_runner_agree():
    """The older FusedMoE (weights on itself) and the runner compute the same layer."""
    state = _experts_state()
    x, logits = torch.randn(T, H, generator=_gen(11)), torch.randn(T, E, generator=_gen(12))
    with layer_context():
        old = FusedMoE(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
        new = FusedMoEFactory(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    old.load_weights(state.items())
    new.load_weights(state.items())
    assert torch.equal(old(x, logits), new(x, logits))


def _tp2_runner_worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(2, 1)
    try:
        state = _block_state()
        x = torch.randn(T, H, generator=_gen(5))
        expected = _reference(x, x @ state["gate.weight"].T, state) + _shared_reference(x, state)
        for expert_parallel in (False, True):
            config = make_vllm_config()
            config.parallel_config.enable_expert_parallel = expert_parallel
            with set_current_vllm_config(config):
                block = _Block()
            _load(block, state)
            experts = block.experts.routed_experts
            assert experts.local_num_experts == (E // 2 if expert_parallel else E)
            torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)
    finally:
        destroy_distributed_environment()


def test_runner_tp2_and_ep2_processes_sum_to_the_whole_layer():
    """Two real gloo ranks: TP slices each expert (and the shared expert), EP splits the experts;
    the runner's one all-reduce gives the unsharded output on both."""
    fork_ok = "fork" in mp.get_all_start_methods() and not dist.is_initialized()
    mp.start_processes(_tp2_runner_worker, args=(free_port(),), nprocs=2, join=True,
                       start_method="fork" if fork_ok else "spawn")


def test_interleaved_swigluoai_places_gate_and_up_rows_alternately():
    """Per-expert gate / up shards under "swigluoai" (gpt-oss's layout) land on even / odd rows,
    so the runner computes what the gate-first "swigluoai_uninterleave" layer does."""
    from minivllm.model_executor.layers.quantization.gguf import GGUFConfig

    state = _experts_state()
    x, logits = torch.randn(T, H, generator=_gen(13)), torch.randn(T, E, generator=_gen(14))
    with layer_context():
        kwargs = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
        interleaved = FusedMoEFactory(activation="swigluoai", **kwargs)
        gate_first = FusedMoEFactory(activation="swigluoai_uninterleave", **kwargs)
        with pytest.raises(NotImplementedError, match="swigluoai_uninterleave"):
            FusedMoEFactory(activation="swigluoai", quant_config=GGUFConfig(), **kwargs)
    interleaved.load_weights(state.items())
    gate_first.load_weights(state.items())
    w13 = interleaved.routed_experts.w13_weight
    assert torch.equal(w13[2, 0::2], state["2.gate_proj.weight"])
    assert torch.equal(w13[2, 1::2], state["2.up_proj.weight"])
    torch.testing.assert_close(interleaved(x, logits), gate_first(x, logits))
