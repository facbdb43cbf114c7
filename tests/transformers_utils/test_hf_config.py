"""make_text_config: transformers' config classes' fields, defaults and derived values, without them."""

import importlib
import pickle

import pytest

from minivllm.transformers_utils.hf_config import TEXT_CONFIG_DEFAULTS, HFTextConfig, make_text_config

CASES = [
    {},                                                             # every default
    {"hidden_size": 64, "num_attention_heads": 4},                 # head_dim and kv heads derived
    {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
     "rope_theta": 5e5, "tie_word_embeddings": True, "num_hidden_layers": 3},
    {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 1, "num_hidden_layers": 3},
    {"name_or_path": "/some/folder", "bos_token_id": 7, "unk_token_id": 0, "_model_name_or_path": "x"},
]


def _transformers_config(model_type: str, **kwargs):
    class_name = TEXT_CONFIG_DEFAULTS[model_type][0]
    module = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    return getattr(module, class_name)(**kwargs)


@pytest.mark.parametrize("model_type", sorted(TEXT_CONFIG_DEFAULTS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fields_equal_transformers(model_type, case):
    kwargs = CASES[case]
    ours = make_text_config(model_type, **kwargs)
    ref = _transformers_config(model_type, **kwargs)
    assert ours.to_dict() == {k: v for k, v in ref.to_dict().items() if k != "transformers_version"}
    for name in ("head_dim", "num_key_value_heads", "sliding_window", "layer_types", "rope_parameters"):
        assert getattr(ours, name, None) == getattr(ref, name, None), name
    assert ours.name_or_path == ref.name_or_path
    assert not hasattr(ours, "rope_theta") and not hasattr(ref, "rope_theta")


def test_pickles_and_copies_are_independent():
    ours = make_text_config("llama", hidden_size=64, num_attention_heads=4)
    copy = pickle.loads(pickle.dumps(ours))
    assert copy == ours and copy is not ours
    copy.rope_parameters["rope_theta"] = 1.0
    assert ours.rope_parameters["rope_theta"] == 10000.0


def test_bad_input_raises():
    with pytest.raises(ValueError, match="not a multiple"):
        make_text_config("llama", hidden_size=65, num_attention_heads=4)
    with pytest.raises(ValueError, match="known: llama, mistral, qwen2, qwen3"):
        make_text_config("gemma")
    assert isinstance(make_text_config("qwen3"), HFTextConfig)
