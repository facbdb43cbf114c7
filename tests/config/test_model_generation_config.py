"""ModelConfig pieces vLLM's files read: `try_get_generation_config` (and
`override_generation_config`; Llama 4's temperature tuning), `str_dtype_to_torch_dtype`, the
KV head count of a heterogeneous config (Gemma 4's global layers have fewer), and CacheConfig's
refused `kv_sharing_fast_prefill`."""

import json

import torch
from transformers import Gemma4TextConfig, LlamaConfig

from minivllm.config import CacheConfig, ModelConfig, str_dtype_to_torch_dtype


def test_generation_config_diff_and_override(tmp_path):
    hf = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4)
    assert ModelConfig(model=str(tmp_path), hf_config=hf).try_get_generation_config() == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"attn_temperature_tuning": True, "temperature": 0.6}))
    config = ModelConfig(model=str(tmp_path), hf_config=hf,
                         override_generation_config={"temperature": 0.2})
    got = config.try_get_generation_config()
    assert got["attn_temperature_tuning"] is True and got["temperature"] == 0.6
    assert config.override_generation_config == {"temperature": 0.2}


def test_str_dtype_to_torch_dtype():
    assert str_dtype_to_torch_dtype("bfloat16") is torch.bfloat16
    assert str_dtype_to_torch_dtype("half") is torch.float16
    assert str_dtype_to_torch_dtype("int3") is None


def test_heterogeneous_kv_heads_give_the_smallest_count():
    hf = Gemma4TextConfig(num_hidden_layers=2, layer_types=["sliding_attention",
                                                            "full_attention"],
                          hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                          attention_k_eq_v=True, vocab_size=100, vocab_size_per_layer_input=100)
    assert hf.is_heterogeneous
    assert ModelConfig(model="dummy", hf_config=hf).get_total_num_kv_heads() == 1


def test_kv_sharing_fast_prefill_is_refused():
    import pytest

    assert CacheConfig().kv_sharing_fast_prefill is False
    with pytest.raises(NotImplementedError, match="kv_sharing_fast_prefill"):
        CacheConfig(kv_sharing_fast_prefill=True)
