"""models/utils.py: prefixes, PP placeholders and layer lists, layer indices, helper factories."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from minivllm.distributed import GroupCoordinator, get_pp_indices, initialize_model_parallel
from minivllm.model_executor.models import utils
from minivllm.model_executor.models.utils import (PPMissingLayer, StageMissingLayer, extract_layer_index,
                                                  get_pp_missing_layer_names, is_pp_missing_parameter,
                                                  make_empty_intermediate_tensors_factory, make_layers,
                                                  maybe_prefix, no_init_weights,
                                                  spec_decode_needs_target_embed)
from minivllm.sequence import IntermediateTensors


class Layer(nn.Module):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.proj = nn.Linear(2, 2)


def _fake_pp(monkeypatch, rank: int, size: int) -> None:
    group = GroupCoordinator(list(range(size)), rank, None, "pp")
    monkeypatch.setattr(utils, "get_pp_group", lambda: group)


def test_maybe_prefix():
    assert maybe_prefix("", "model") == "model"
    assert maybe_prefix("model", "layers") == "model.layers"


def test_make_layers_single_stage():
    initialize_model_parallel(1, 1)
    start, end, layers = make_layers(3, lambda prefix: Layer(prefix), prefix="model.layers")
    assert (start, end) == (0, 3)
    assert [layer.prefix for layer in layers] == [f"model.layers.{i}" for i in range(3)]


@pytest.mark.parametrize("rank,expected", [(0, (0, 2)), (1, (2, 5)), (2, (5, 8)), (3, (8, 10))])
def test_make_layers_with_pp_keeps_global_indices(monkeypatch, rank, expected):
    _fake_pp(monkeypatch, rank, 4)
    start, end, layers = make_layers(10, lambda prefix: Layer(prefix), prefix="model.layers")
    assert (start, end) == expected
    assert len(layers) == 10
    for idx, layer in enumerate(layers):
        if start <= idx < end:
            assert isinstance(layer, Layer) and layer.prefix == f"model.layers.{idx}"
        else:
            assert isinstance(layer, PPMissingLayer)
    names = {n for n, _ in layers.named_parameters()}
    assert names == {f"{i}.proj.{p}" for i in range(start, end) for p in ("weight", "bias")}


def test_get_pp_indices_default_and_env(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert [get_pp_indices(10, r, 4) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,4,5")
    assert [get_pp_indices(10, r, 3) for r in range(3)] == [(0, 1), (1, 5), (5, 10)]


@pytest.mark.parametrize("value,match", [("1,x", "comma-separated"), ("5,5", "entries"),
                                         ("1,2,3", "sums to")])
def test_get_pp_indices_env_errors(monkeypatch, value, match):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", value)
    with pytest.raises(ValueError, match=match):
        get_pp_indices(10, 0, 3)


def test_pp_missing_layer_passes_input_through():
    layer = PPMissingLayer(1, 2, foo="bar")
    x = torch.ones(2)
    assert layer(x, torch.zeros(1)) is x
    assert layer(hidden_states=x) is x


def test_stage_missing_layer_raises_and_hides_params():
    head = nn.Linear(2, 3)
    placeholder = StageMissingLayer("output", head)
    assert placeholder.module is head
    assert list(placeholder.parameters()) == []
    with pytest.raises(RuntimeError, match="'output' stage"):
        placeholder(torch.ones(2))


def test_is_pp_missing_parameter():
    model = nn.Module()
    model.layers = nn.ModuleList([PPMissingLayer(), Layer("x")])
    model.head = StageMissingLayer("output")
    assert get_pp_missing_layer_names(model) == ["layers.0.", "head."]
    assert is_pp_missing_parameter("layers.0.proj.weight", model)
    assert is_pp_missing_parameter("head.weight", model)
    assert not is_pp_missing_parameter("layers.1.proj.weight", model)
    assert not is_pp_missing_parameter("layers.10.proj.weight", model)   # trailing dot matters


@pytest.mark.parametrize("name,expected", [("model.layers.3.self_attn.attn", 3), ("layers.0", 0),
                                           ("model.layers.12.mlp", 12)])
def test_extract_layer_index(name, expected):
    assert extract_layer_index(name) == expected


@pytest.mark.parametrize("name", ["model.norm", "model.layers.1.experts.2.attn"])
def test_extract_layer_index_needs_exactly_one_integer(name):
    with pytest.raises(AssertionError, match="should only contain one integer"):
        extract_layer_index(name)


def test_extract_layer_index_several_attention_modules():
    assert extract_layer_index("model.layers.2.attn.1", num_attn_module=2) == 5


def test_empty_intermediate_tensors_factory():
    make = make_empty_intermediate_tensors_factory(["hidden_states", "residual"], 8)
    it = make(batch_size=3, dtype=torch.float16, device="cpu")
    assert isinstance(it, IntermediateTensors) and set(it.tensors) == {"hidden_states", "residual"}
    assert it["residual"].shape == (3, 8) and it["residual"].dtype == torch.float16
    assert not it["hidden_states"].any()


@pytest.mark.parametrize("method,include_mtp,rank,size,expected", [
    ("eagle3", False, 1, 2, True), ("eagle", False, 0, 2, False), ("dflash", False, 0, 1, False),
    ("mtp", False, 1, 2, False), ("mtp", True, 1, 2, True), ("ngram", False, 1, 2, False)])
def test_spec_decode_needs_target_embed(monkeypatch, method, include_mtp, rank, size, expected):
    _fake_pp(monkeypatch, rank, size)
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(method=method))
    assert spec_decode_needs_target_embed(cfg, include_mtp=include_mtp) is expected
    assert spec_decode_needs_target_embed(SimpleNamespace(speculative_config=None)) is False


class LogitsProcessor(nn.Module):   # matched by class name, like the real layer
    pass


class ParallelLMHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 2))


class ToyLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 2)
        self.lm_head = ParallelLMHead()
        if tied:
            self.lm_head.weight = self.embed.weight
        self.logits_processor = LogitsProcessor()


@pytest.mark.parametrize("tied", [False, True])
def test_no_init_weights_replaces_output_stage(tied):
    model = ToyLM.__new__(ToyLM)
    with no_init_weights(model, lambda m: StageMissingLayer("output", m),
                         targets=("ParallelLMHead", "LogitsProcessor")):
        ToyLM.__init__(model, tied)
    assert isinstance(model.lm_head, StageMissingLayer) and isinstance(model.logits_processor, StageMissingLayer)
    assert {n for n, _ in model.named_parameters()} == {"embed.weight"}
    old_head = model.lm_head.module
    # An untied head moves to meta; a tied one keeps sharing the live embedding weight.
    assert old_head.weight.is_meta is (not tied)
    assert model.embed.weight.device.type == "cpu"


def test_spec_layers_are_named_and_skipped():
    """MTP layers follow the decoder layers: their weights leave the base model's stream."""
    config = SimpleNamespace(num_hidden_layers=2, num_nextn_predict_layers=1)
    names = ["model.layers.1.mlp.gate.weight", "model.layers.2.eh_proj.weight",
             "model.layers.20.mlp.gate.weight", "lm_head.weight"]
    assert [utils.get_spec_layer_idx_from_weight_name(config, n) for n in names] == [
        None, 2, None, None]
    kept = [n for n, _ in utils.skip_spec_layers(((n, None) for n in names), config)]
    assert kept == [names[0], names[2], names[3]]
    no_mtp = SimpleNamespace(num_hidden_layers=2)
    assert utils.get_spec_layer_idx_from_weight_name(no_mtp, names[1]) is None


def test_sequence_parallel_chunk_pads_and_slices(monkeypatch):
    x = torch.arange(10.0).reshape(5, 2)
    assert utils.sequence_parallel_chunk(x) is x                      # TP = 1
    monkeypatch.setattr(utils, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(utils, "get_tensor_model_parallel_rank", lambda: 1)
    chunk = utils.sequence_parallel_chunk(x)                           # 5 rows -> 3 + 3
    assert torch.equal(chunk, torch.tensor([[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]]))


def test_shared_experts_are_never_fused():
    from minivllm.model_executor.layers.fused_moe import utils as moe_utils

    stream = [("model.layers.0.mlp.shared_experts.gate_proj.weight", None)]
    assert list(utils.maybe_fuse_shared_experts(iter(stream), n_routed_experts=8,
                                                n_shared_experts=1)) == stream
    with pytest.raises(NotImplementedError, match="AITER"):
        utils.maybe_fuse_shared_experts(iter(stream), n_routed_experts=8, n_shared_experts=1,
                                        enabled=True)
    assert moe_utils.resolve_layer_fused_shared_expert(None, "model.layers.0.mlp") is False
    fused, plain = nn.Module(), nn.Module()
    fused.mlp, plain.mlp = nn.Linear(1, 1), nn.Linear(1, 1)
    fused.mlp.is_fused_shared_expert_enabled = True
    assert moe_utils.is_model_fused_shared_expert_compatible([plain], nn.Linear, "mlp") is False
    assert moe_utils.is_model_fused_shared_expert_compatible([fused], nn.Linear, "mlp") is True
    with pytest.raises(NotImplementedError, match="1 of 2"):
        moe_utils.is_model_fused_shared_expert_compatible([fused, plain], nn.Linear, "mlp")
