"""Quantization hooks: skip rules, config key lookup, the unquantized defaults."""

import pytest
import torch

from minivllm.model_executor.layers.quantization import (QuantizationConfig,
                                                         UnquantizedEmbeddingMethod,
                                                         UnquantizedLinearMethod, is_layer_skipped,
                                                         method_has_implemented_embedding)

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def test_is_layer_skipped_rules():
    prefix = "model.layers.0.self_attn.qkv_proj"
    assert not is_layer_skipped(prefix, [], FUSED)
    assert is_layer_skipped(prefix, [prefix], FUSED)  # the fused name itself is listed
    shards = [prefix.replace("qkv_proj", s) for s in FUSED["qkv_proj"]]
    assert is_layer_skipped(prefix, shards, FUSED)
    with pytest.raises(ValueError, match="some but not all shards"):
        is_layer_skipped(prefix, shards[:1], FUSED)
    assert is_layer_skipped("model.layers.0.mlp.down_proj", ["mlp"], match_mode="substring")
    assert is_layer_skipped("model.layers.0.mlp.down_proj", ["down_proj"], match_mode="suffix")
    with pytest.raises(ValueError, match="match_mode must be one of"):
        is_layer_skipped("x", [], match_mode="regex")


def test_config_helpers_and_defaults():
    config = {"bits": 4, "group_size": 128}
    assert QuantizationConfig.get_from_keys(config, ["w_bit", "bits"]) == 4
    assert QuantizationConfig.get_from_keys_or(config, ["zero_point"], False) is False
    with pytest.raises(ValueError, match="Cannot find any of"):
        QuantizationConfig.get_from_keys(config, ["missing"])
    assert ".k_scale" in QuantizationConfig._ignore_unexpected_suffixes
    assert method_has_implemented_embedding(UnquantizedEmbeddingMethod)
    assert not method_has_implemented_embedding(UnquantizedLinearMethod)
    layer, embed = torch.nn.Module(), torch.nn.Embedding(4, 2)
    assert UnquantizedEmbeddingMethod().tie_weights(layer, embed).weight is embed.weight
