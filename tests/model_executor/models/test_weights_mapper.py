"""WeightsMapper: the six stages, their order, shard ids on tensors, merging and rename copies."""

import re

import torch

from minivllm.model_executor.models.utils import WeightsMapper

LLAMA_STACKED = WeightsMapper(orig_to_new_stacked={
    ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1),
})


def test_stacked_rules_and_shard_ids():
    assert LLAMA_STACKED._map_name_with_shard("layers.3.self_attn.k_proj.weight") == (
        "layers.3.self_attn.qkv_proj.weight", "k")
    assert LLAMA_STACKED._map_name_with_shard("layers.0.mlp.gate_proj.weight") == (
        "layers.0.mlp.gate_up_proj.weight", 0)
    assert LLAMA_STACKED._map_name_with_shard("layers.0.mlp.up_proj.weight") == (
        "layers.0.mlp.gate_up_proj.weight", 1)
    # An already fused checkpoint name is left alone: ".up_proj" must not match ".gate_up_proj".
    assert LLAMA_STACKED._map_name_with_shard("layers.0.mlp.gate_up_proj.weight") == (
        "layers.0.mlp.gate_up_proj.weight", None)
    assert LLAMA_STACKED.map_name("norm.weight") == "norm.weight"


def test_apply_writes_shard_id_on_tensors():
    weights = [("layers.0.self_attn.v_proj.weight", torch.ones(2)),
               ("layers.0.mlp.up_proj.weight", torch.zeros(2)),
               ("norm.weight", torch.zeros(3))]
    out = list(LLAMA_STACKED.apply(weights))
    assert [n for n, _ in out] == ["layers.0.self_attn.qkv_proj.weight",
                                   "layers.0.mlp.gate_up_proj.weight", "norm.weight"]
    assert out[0][1].shard_id == "v" and out[1][1].shard_id == 1
    assert not hasattr(out[2][1], "shard_id")
    assert out[0][1] is weights[0][1]   # no copy


def test_list_of_shard_ids_yields_one_alias_per_id():
    mapper = WeightsMapper(orig_to_new_stacked={".kv": (".qkv", ["k", "v"])})
    tensor = torch.arange(4.0)
    out = list(mapper.apply([("attn.kv.weight", tensor)]))
    assert [(n, t.shard_id) for n, t in out] == [("attn.qkv.weight", "k"), ("attn.qkv.weight", "v")]
    assert out[1][1].data_ptr() == tensor.data_ptr()


class _Renaming:
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def rename_source_key(self, key: str):
        return key.replace(self.old, self.new), None   # transformers returns (key, pattern)


def test_stage_order_renaming_regex_substr_stacked_prefix_suffix():
    mapper = WeightsMapper(
        orig_to_new_renaming=[_Renaming("transformer.", "model.")],
        orig_to_new_regex={r"\.h\.(\d+)\.": r".layers.\1."},
        orig_to_new_substr={".attn.": ".self_attn."},
        orig_to_new_stacked={".wq": (".qkv_proj", "q")},
        orig_to_new_prefix={"model.": ""},
        orig_to_new_suffix={".weight": ".w"},
    )
    # renaming -> model.h.2...; regex -> model.layers.2...; substr -> .self_attn.;
    # stacked -> qkv_proj; prefix strips "model."; suffix renames the ending.
    assert mapper._map_name_with_shard("transformer.h.2.attn.wq.weight") == (
        "layers.2.self_attn.qkv_proj.w", "q")


def test_none_targets_drop_and_regex_applies_every_match():
    mapper = WeightsMapper(orig_to_new_regex={re.compile(r"^a"): "b", r"^b": "c"},
                           orig_to_new_substr={"rotary_emb.inv_freq": None},
                           orig_to_new_prefix={"vision.": None}, orig_to_new_suffix={".unused": None})
    assert mapper.map_name("a.x") == "c.x"
    assert mapper.map_name("layers.0.rotary_emb.inv_freq") is None
    assert mapper.map_name("vision.proj") is None
    assert mapper.map_name("x.unused") is None
    assert list(mapper.apply([("vision.proj", torch.ones(1))])) == []
    assert mapper.apply_list(["a.x", "vision.y", "q"]) == ["c.x", "q"]
    assert mapper.apply_dict({"a.x": 1, "x.unused": 2}) == {"c.x": 1}


def test_substr_replaces_first_occurrence_only():
    mapper = WeightsMapper(orig_to_new_substr={"a": "b"})
    assert mapper.map_name("a.a") == "b.a"


def test_or_merges_with_right_side_winning():
    left = WeightsMapper(orig_to_new_prefix={"x.": "y.", "k.": "l."}, orig_to_new_stacked={".a": (".b", 0)})
    right = WeightsMapper(orig_to_new_prefix={"x.": "z."})
    merged = left | right
    assert merged.orig_to_new_prefix == {"x.": "z.", "k.": "l."}
    assert merged.orig_to_new_stacked == {".a": (".b", 0)}


def test_rename_mapper_drops_stacked_and_none_rules():
    mapper = WeightsMapper(orig_to_new_substr={"drop": None, "old": "new"},
                           orig_to_new_stacked={".q_proj": (".qkv_proj", "q")},
                           orig_to_new_prefix={"model.": None, "m.": "model."})
    rename = mapper.get_rename_mapper()
    assert rename.orig_to_new_stacked == {}
    assert rename.orig_to_new_substr == {"old": "new"}
    assert rename.orig_to_new_prefix == {"m.": "model."}
    # Quant configs see q_proj names unchanged.
    assert rename.map_name("m.layers.0.self_attn.q_proj") == "model.layers.0.self_attn.q_proj"
