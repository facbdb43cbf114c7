"""ModelRegistry: vLLM's lazy table, resolution, registration forms and their errors."""

import importlib
import importlib.util
import sys

import pytest
import torch.nn as nn

from minivllm.model_executor.models.registry import (_VLLM_MODELS, ModelRegistry, _LazyRegisteredModel,
                                                     _ModelRegistry, _RegisteredModel)

LLAMA_ARCHS = ["InternLM3ForCausalLM", "IQuestCoderForCausalLM", "LlamaForCausalLM", "LLaMAForCausalLM",
               "TeleChat3ForCausalLM"]


def _module_exists(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_vllm_names_are_registered():
    archs = set(ModelRegistry.get_supported_archs())
    assert set(LLAMA_ARCHS) <= archs
    assert {"LlamaModel", "MistralModel", "LlamaBidirectionalModel",
            "LlamaBidirectionalForSequenceClassification"} <= archs
    assert all(_VLLM_MODELS[a] == ("llama", "LlamaForCausalLM") for a in LLAMA_ARCHS + ["LlamaModel"])


def test_table_is_lazy():
    entry = ModelRegistry.models["LlamaBidirectionalModel"]
    assert isinstance(entry, _LazyRegisteredModel)
    assert entry.module_name == "minivllm.model_executor.models.llama"


def test_every_entry_resolves():
    # vLLM's names only (other tests may register toy classes in the global registry); an entry
    # may name only a model file that exists.
    entries = {arch: ModelRegistry.models[arch] for arch in _VLLM_MODELS}
    for arch, entry in entries.items():
        assert _module_exists(entry.module_name), f"{arch} -> missing {entry.module_name}"
        cls, resolved = ModelRegistry.resolve_model_cls([arch])
        assert resolved == arch and isinstance(cls, type) and issubclass(cls, nn.Module)
        assert cls is getattr(importlib.import_module(entry.module_name), entry.class_name)


def test_llama_capabilities():
    assert ModelRegistry.is_text_generation_model(["LlamaForCausalLM"])
    assert ModelRegistry.is_pp_supported_model(["LlamaForCausalLM"])
    info, arch = ModelRegistry.inspect_model_cls(["LlamaForCausalLM"])
    assert arch == "LlamaForCausalLM"
    assert info.supports_lora and info.supports_quant and not info.is_pooling_model


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError) as info:
        ModelRegistry.resolve_model_cls(["NopeForCausalLM"])
    msg = str(info.value)
    assert "Model architectures ['NopeForCausalLM'] are not supported for now." in msg
    # grouped by model file, each family's names sorted
    assert "Supported architectures, by model file: " in msg
    assert "; llama: InternLM3ForCausalLM, IQuestCoderForCausalLM, " in msg
    assert "phi3: Phi3ForCausalLM" in msg and "commandr: Cohere2ForCausalLM, CohereForCausalLM" in msg
    with pytest.raises(ValueError, match="No model architectures"):
        ModelRegistry.resolve_model_cls([])


def test_first_known_architecture_wins():
    cls, arch = ModelRegistry.resolve_model_cls(["NopeForCausalLM", "LlamaForCausalLM"])
    assert arch == "LlamaForCausalLM" and cls.__name__ == "LlamaForCausalLM"


class MyModel(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()

    def forward(self, input_ids, positions, intermediate_tensors=None):
        return input_ids


def test_register_model_forms():
    registry = _ModelRegistry({})
    registry.register_model("MyModel", MyModel)
    assert isinstance(registry.models["MyModel"], _RegisteredModel)
    assert registry.resolve_model_cls("MyModel") == (MyModel, "MyModel")
    registry.register_model("Lazy", f"{__name__}:MyModel")
    sys.modules.setdefault(__name__, sys.modules[MyModel.__module__])
    assert isinstance(registry.models["Lazy"], _LazyRegisteredModel)
    assert registry.resolve_model_cls(["Lazy"])[0].__name__ == "MyModel"
    registry.register_model("MyModel", f"{__name__}:MyModel")   # overwrite is allowed
    assert isinstance(registry.models["MyModel"], _LazyRegisteredModel)
    info, _ = registry.inspect_model_cls("Lazy")
    assert not info.is_text_generation_model and not info.supports_pp


def test_register_model_errors():
    registry = _ModelRegistry({})
    with pytest.raises(TypeError):
        registry.register_model(1, MyModel)
    with pytest.raises(ValueError, match="<module>:<class>"):
        registry.register_model("X", "no_colon_here")
    with pytest.raises(TypeError):
        registry.register_model("X", object)
    with pytest.raises(TypeError):
        registry.register_model("X", MyModel())


def test_broken_module_fails_inspection():
    registry = _ModelRegistry({})
    registry.register_model("Broken", "minivllm.no_such_module:Nope")
    with pytest.raises(ValueError, match="failed to be inspected"):
        registry.resolve_model_cls(["Broken"])


def test_top_level_lazy_export():
    import minivllm

    assert minivllm.ModelRegistry is ModelRegistry


def test_family_without_a_model_file_is_a_clear_error():
    # No falcon.py: a Falcon checkpoint gets the supported list, not a ModuleNotFoundError.
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*not supported.*Qwen2ForCausalLM"):
        ModelRegistry.resolve_model_cls(["FalconForCausalLM"])
