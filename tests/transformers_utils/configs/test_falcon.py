"""Legacy Falcon ("RefinedWebModel") config.json files read as `RWConfig` under transformers'
Falcon field names."""

import json

from minivllm.transformers_utils.config import get_config
from minivllm.transformers_utils.configs import RWConfig


def test_refinedweb_config_reads_under_falcon_names(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "RefinedWebModel", "architectures": ["RWForCausalLM"], "n_head": 8,
        "n_layer": 3, "n_embed": 128, "vocab_size": 500, "multi_query": True, "alibi": False,
        "parallel_attn": True, "bias": False}))
    config = get_config(str(tmp_path))
    assert isinstance(config, RWConfig)
    assert (config.num_attention_heads, config.num_hidden_layers, config.hidden_size) == (8, 3, 128)
    assert config.num_kv_heads == 1 and config.head_dim == 16     # multi-query: one KV head
    assert config.rotary and config.rope_parameters["rope_theta"] == 10000.0
    assert not config.new_decoder_architecture


def test_falcon_40b_width_implies_the_new_decoder_architecture():
    assert RWConfig(hidden_size=8192, n_head=128, n_head_kv=8).new_decoder_architecture
    assert not RWConfig(alibi=True).rotary
