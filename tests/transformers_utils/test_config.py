"""get_config: GGUF metadata gives the config transformers' GGUF loader gives; folders as before."""

import os

import pytest
from transformers import AutoConfig

from minivllm.transformers_utils import config as config_module
from minivllm.transformers_utils.config import get_config, patch_rope_parameters
from minivllm.transformers_utils.hf_config import HFTextConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _reference(path: str, architecture: str):
    """What `AutoConfig.from_pretrained(folder, gguf_file=...)` gives, as get_config delivers it."""
    ref = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ref.architectures = [architecture]
    patch_rope_parameters(ref)
    return ref


def _assert_same_config(ours, ref) -> None:
    """Our transformers-free config holds transformers' fields; to_hf() gives its very class."""
    assert isinstance(ours, HFTextConfig) and ours.model_type == ref.model_type
    assert ours.to_dict() == {k: v for k, v in ref.to_dict().items() if k != "transformers_version"}
    hf = ours.to_hf()
    assert type(hf) is type(ref) and hf.to_dict() == ref.to_dict()
    assert ours.name_or_path == ref.name_or_path and ours.get_text_config() is ours


def test_default_model_config_equals_transformers(default_model_path):
    ours = get_config(default_model_path)
    ref = _reference(default_model_path, "LlamaForCausalLM")
    _assert_same_config(ours, ref)
    shape = (ours.num_hidden_layers, ours.hidden_size, ours.num_key_value_heads, ours.head_dim)
    assert shape == (30, 576, 3, 64)
    assert ours.tie_word_embeddings and ours.vocab_size == 49152
    assert ours.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("tied", [False, True])
def test_synthetic_files_equal_transformers(tiny_gguf, arch, tied):
    path = tiny_gguf(arch, arch=arch, tied=tied)
    ours = get_config(path)
    ref = _reference(path, ARCHITECTURES[arch])
    _assert_same_config(ours, ref)
    assert ours.architectures == [ARCHITECTURES[arch]] and ours.tie_word_embeddings is tied
    assert ours.vocab_size == 14 and ours.bos_token_id == 1 and ours.eos_token_id == 0


def test_gguf_config_skips_auto_config(tiny_gguf, monkeypatch):
    # The known families build their config class directly: AutoConfig's GGUF path re-parses.
    import transformers

    def fail(*args, **kwargs):
        raise AssertionError("AutoConfig.from_pretrained was called")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fail)
    assert get_config(tiny_gguf()).architectures == ["LlamaForCausalLM"]


def test_other_architectures_use_transformers_converter(tiny_gguf, monkeypatch):
    path = tiny_gguf("starcoder2", arch="starcoder2")
    assert "starcoder2" not in config_module._GGUF_ARCHS
    config = get_config(path)
    assert config.model_type == "starcoder2" and config.architectures == ["starcoder2"]


def test_folder_config_is_auto_config(tiny_llama_factory):
    folder = tiny_llama_factory()
    ours = get_config(folder)
    ref = AutoConfig.from_pretrained(folder)
    patch_rope_parameters(ref)
    assert ours.to_dict() == ref.to_dict()


def test_bad_paths_raise(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        get_config(str(tmp_path))
    with pytest.raises(ValueError, match="neither a folder nor a .gguf"):
        get_config(str(tmp_path / "missing"))


def test_legacy_mrope_type_beside_rope_type_is_the_default_type():
    """Qwen2(.5)-VL's {"type": "mrope"} next to transformers 5's derived "rope_type": "default"
    is one type (sections kept); a real conflict still raises."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(rope_parameters={"type": "mrope", "rope_type": "default",
                                           "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    patch_rope_parameters(cfg)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e6,
                                   "mrope_section": [16, 24, 24]}
    bad = SimpleNamespace(rope_parameters={"type": "mrope", "rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="conflicting 'type'='mrope'"):
        patch_rope_parameters(bad)
