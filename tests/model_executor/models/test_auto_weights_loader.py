"""AutoWeightsLoader on toy modules: descent, delegation, placeholders, errors, tied aliases."""

import pytest
import torch
import torch.nn as nn

from minivllm.model_executor.models.utils import (AutoWeightsLoader, PPMissingLayer, StageMissingLayer,
                                                  UnexpectedWeightsError, WeightsMapper)


class FusedQKV(nn.Module):
    """A fused layer that, like QKVParallelLinear, reads the shard id from the tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(6, 2), requires_grad=False)

    def load_weights(self, weights):
        offsets = {"q": 0, "k": 2, "v": 4}
        loaded = set()
        for name, w in weights:
            self.weight.data[offsets[w.shard_id]: offsets[w.shard_id] + 2].copy_(w)
            loaded.add(name)
        return loaded


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = FusedQKV()
        self.norm = nn.LayerNorm(2)
        self.register_buffer("k_scale", torch.zeros(()))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


class Inner(nn.Module):
    mapper = WeightsMapper(orig_to_new_stacked={".q_proj": (".qkv_proj", "q"),
                                                ".k_proj": (".qkv_proj", "k"),
                                                ".v_proj": (".qkv_proj", "v")})

    def __init__(self, num_layers: int = 2, missing: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.layers = nn.ModuleList([PPMissingLayer() if i in missing else Block()
                                     for i in range(num_layers)])
        self.final = nn.Linear(2, 2, bias=False)

    def load_weights(self, weights):
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.mapper)


class Outer(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.model = Inner(**kw)
        self.head = nn.Linear(2, 3)


def _hf_weights(num_layers=2, extra=()):
    gen = torch.Generator().manual_seed(0)
    names = []
    for i in range(num_layers):
        names += [f"model.layers.{i}.{p}_proj.weight" for p in "qkv"]
        names += [f"model.layers.{i}.norm.weight", f"model.layers.{i}.norm.bias", f"model.layers.{i}.k_scale"]
    names += ["model.final.weight", "head.weight", "head.bias", *extra]
    shapes = {"k_scale": (), "norm": (2,), "head.bias": (3,), "head.weight": (3, 2)}
    out = []
    for n in names:
        shape = next((s for k, s in shapes.items() if k in n), (2, 2))
        out.append((n, torch.randn(shape, generator=gen)))
    return out


def test_nested_load_with_delegation_buffers_and_shard_ids():
    model = Outer()
    weights = _hf_weights()
    loaded = AutoWeightsLoader(model).load_weights(iter(weights))
    by_name = dict(weights)
    qkv = model.model.layers[1].qkv_proj.weight
    assert torch.equal(qkv[0:2], by_name["model.layers.1.q_proj.weight"])
    assert torch.equal(qkv[4:6], by_name["model.layers.1.v_proj.weight"])
    assert torch.equal(model.model.layers[0].k_scale, by_name["model.layers.0.k_scale"])
    assert torch.equal(model.head.bias, by_name["head.bias"])
    params = {n for n, _ in model.named_parameters()}
    assert params <= loaded   # every parameter loaded; names qualified from the root
    assert "model.layers.0.qkv_proj.weight" in loaded
    assert "model.layers.0.k_scale" in loaded


def test_placeholders_drop_their_weights_silently():
    model = Outer(missing=(0,))
    loaded = AutoWeightsLoader(model).load_weights(_hf_weights())
    assert not any(n.startswith("model.layers.0.") for n in loaded)
    assert "model.layers.1.norm.weight" in loaded

    model.head = StageMissingLayer("output", model.head)
    loaded = AutoWeightsLoader(model).load_weights(_hf_weights())
    assert not any(n.startswith("head") for n in loaded)
    assert "head.weight" not in {n for n, _ in model.named_parameters()}


def test_every_unexpected_name_is_listed_in_one_error():
    model = Outer()
    extra = ("model.layers.1.mystery.weight", "model.bogus", "unknown.weight", "head.weight.nested")
    with pytest.raises(UnexpectedWeightsError) as info:
        AutoWeightsLoader(model).load_weights(_hf_weights(extra=extra))
    err = info.value
    assert isinstance(err, ValueError)
    assert [n.split(" ")[0] for n in err.unexpected] == list(extra)
    for name in extra:
        assert name in str(err)
    # Everything else was still loaded and is reported on the error.
    assert "model.layers.1.norm.weight" in err.loaded and "head.bias" in err.loaded


def test_ignorable_names_bias_and_rotary_caches():
    model = Outer()
    extra = ("model.layers.0.rotary_emb.inv_freq", "model.final.bias", "vision.proj", "x.scale_ub")
    loader = AutoWeightsLoader(model, ignore_unexpected_prefixes=["vision."],
                               ignore_unexpected_suffixes=[".scale_ub"])
    loaded = loader.load_weights(_hf_weights(extra=extra))
    assert not set(extra) & loaded


class VocabParallelEmbedding(nn.Module):   # matched by class name, like the real layer
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(5, 2), requires_grad=False)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding()
        self.lm_head = ParallelLMHead()
        self.lm_head.weight = self.embed_tokens.weight


def test_tied_alias_is_dropped_and_canonical_loaded():
    model = TiedLM()
    loader = AutoWeightsLoader(model)
    assert loader.aliased_params == {"lm_head.weight": "embed_tokens.weight"}
    embed = torch.randn(5, 2)
    loaded = loader.load_weights([("embed_tokens.weight", embed), ("lm_head.weight", torch.randn(5, 2))])
    assert loaded == {"embed_tokens.weight"}
    assert torch.equal(model.lm_head.weight, embed)


def test_tied_alias_without_canonical_raises():
    with pytest.raises(ValueError, match="'lm_head.weight' was skipped because it is tied to "
                                         "'embed_tokens.weight'"):
        AutoWeightsLoader(TiedLM()).load_weights([("lm_head.weight", torch.randn(5, 2))])


def test_only_consecutive_names_are_grouped():
    model = Outer()
    weights = _hf_weights()
    # Interleave: the head weight between two groups of the inner model.
    reordered = weights[:3] + [w for w in weights if w[0] == "head.weight"] + weights[3:]
    loaded = AutoWeightsLoader(model).load_weights(reordered)
    assert {n for n, _ in model.named_parameters()} <= loaded


def test_narrowing_casts_warn_for_matrices_only():
    """fp32 norm weights beside bf16 matrices (every GGUF file) load quietly; an fp32 matrix
    loaded into bf16 is worth one warning, once."""
    from tests.conftest import captured_log

    model = nn.Module()
    model.norm = nn.Module()
    model.norm.weight = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
    model.proj = nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    with captured_log("minivllm.model_executor.models.auto_weights_loader") as lines:
        AutoWeightsLoader(model).load_weights([("norm.weight", torch.ones(4))])
        assert lines == [] and model.norm.weight.dtype == torch.bfloat16
        AutoWeightsLoader(model).load_weights([("proj.weight", torch.ones(4, 4))])
        assert lines == ["Casting checkpoint weights from torch.float32 to "
                         "torch.bfloat16 (first: proj.weight)"]
    assert torch.equal(model.proj.weight, torch.ones(4, 4, dtype=torch.bfloat16))
