"""The model registry: architecture name -> (module, class), imported only when asked for."""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from minivllm.logger import init_logger
from minivllm.model_executor.models import interfaces as itf
from minivllm.model_executor.models.adapters import as_embedding_model, as_seq_cls_model

logger = init_logger(__name__)

_MODELS_PACKAGE = "minivllm.model_executor.models"
_LLAMA = ("llama", "LlamaForCausalLM")

# vLLM 0.33's names whose model files minivllm ships (contract §6.1); every entry names a module
# that exists (tests/model_executor/models/test_registry.py imports each one).
_TEXT_GENERATION_MODELS: dict[str, tuple[str, str]] = {
    "InternLM3ForCausalLM": _LLAMA,
    "IQuestCoderForCausalLM": _LLAMA,
    "LlamaForCausalLM": _LLAMA,
    "LLaMAForCausalLM": _LLAMA,
    "TeleChat3ForCausalLM": _LLAMA,
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
    # Served text-only (the vision tower's weights are skipped; see qwen3_5.py).
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    # Served text-only as Qwen2 / Qwen3 / Qwen3-MoE (vision towers skipped; see qwen_vl.py).
    "Qwen2VLForConditionalGeneration": ("qwen_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen_vl", "Qwen3VLMoeForConditionalGeneration"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("deepseek_v2", "Glm4MoeLiteForCausalLM"),
    "Lfm2ForCausalLM": ("lfm2", "Lfm2ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "PhiMoEForCausalLM": ("phimoe", "PhiMoEForCausalLM"),
    # transformers 5 saves PhiMoE checkpoints under its own spelling of the name.
    "PhimoeForCausalLM": ("phimoe", "PhiMoEForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "StableLmForCausalLM": ("stablelm", "StablelmForCausalLM"),
    "StableLMEpochForCausalLM": ("stablelm", "StablelmForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
    "GlmForCausalLM": ("glm", "GlmForCausalLM"),
    "CohereForCausalLM": ("commandr", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("commandr", "CohereForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "GraniteSWAForCausalLM": ("granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("granitemoe", "GraniteMoeForCausalLM"),
    # vLLM points these two at its granitemoeshared.py; minivllm keeps them in granitemoe.py.
    "GraniteMoeSharedForCausalLM": ("granitemoe", "GraniteMoeSharedForCausalLM"),
    "GraniteMoeSWAForCausalLM": ("granitemoe", "GraniteMoeSharedForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "SeedOssForCausalLM": ("seed_oss", "SeedOssForCausalLM"),
    "ApertusForCausalLM": ("apertus", "ApertusForCausalLM"),
    "ArceeForCausalLM": ("arcee", "ArceeForCausalLM"),
    "Exaone4ForCausalLM": ("exaone4", "Exaone4ForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie45", "Ernie4_5ForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie45_moe", "Ernie4_5_MoeForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Ministral3ForCausalLM": ("mistral", "MistralForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLM"),
    "Gemma3nForCausalLM": ("gemma3n", "Gemma3nForCausalLM"),
    "Gemma3nForConditionalGeneration": ("gemma3n", "Gemma3nForConditionalGeneration"),
    # Vision-language checkpoints served text-only as their language model (see text_only.py).
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),
    "Gemma4ForConditionalGeneration": ("gemma4_mm", "Gemma4ForConditionalGeneration"),
    "Mistral3ForConditionalGeneration": ("mistral", "Mistral3ForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
    "SmolVLMForConditionalGeneration": ("idefics3", "SmolVLMForConditionalGeneration"),
}
_EMBEDDING_MODELS: dict[str, tuple[str, str]] = {
    "LlamaModel": _LLAMA,
    "MistralModel": _LLAMA,
    **{arch: target for arch, target in _TEXT_GENERATION_MODELS.items() if target == _LLAMA},
    "LlamaBidirectionalModel": ("llama", "LlamaBidirectionalModel"),
    "Qwen2Model": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Gemma2Model": ("gemma2", "Gemma2ForCausalLM"),
}
_SEQUENCE_CLASSIFICATION_MODELS: dict[str, tuple[str, str]] = {
    "LlamaBidirectionalForSequenceClassification": ("llama", "LlamaBidirectionalForSequenceClassification"),
}
# EAGLE heads, built by the speculative proposer beside the target (never served alone).
_SPECULATIVE_DECODING_MODELS: dict[str, tuple[str, str]] = {
    "EagleLlamaForCausalLM": ("llama_eagle", "EagleLlamaForCausalLM"),
    "Eagle3LlamaForCausalLM": ("llama_eagle3", "Eagle3LlamaForCausalLM"),
    "LlamaForCausalLMEagle3": ("llama_eagle3", "Eagle3LlamaForCausalLM"),
}
_VLLM_MODELS = {**_TEXT_GENERATION_MODELS, **_EMBEDDING_MODELS, **_SEQUENCE_CLASSIFICATION_MODELS,
                **_SPECULATIVE_DECODING_MODELS}


@dataclass(frozen=True)
class _ModelInfo:
    """What the engine needs to know about a model class, computed in-process."""

    architecture: str
    is_text_generation_model: bool
    is_pooling_model: bool
    supports_pp: bool
    supports_lora: bool
    supports_quant: bool
    is_hybrid: bool = False
    has_inner_state: bool = False

    @staticmethod
    def from_model_cls(model_cls: type[nn.Module]) -> "_ModelInfo":
        return _ModelInfo(architecture=model_cls.__name__,
                          is_text_generation_model=itf.is_text_generation_model(model_cls),
                          is_pooling_model=itf.is_pooling_model(model_cls),
                          supports_pp=itf.supports_pp(model_cls),
                          supports_lora=itf.supports_lora(model_cls),
                          supports_quant=itf.supports_quant(model_cls),
                          is_hybrid=itf.is_hybrid(model_cls),
                          has_inner_state=itf.has_inner_state(model_cls))


class _LazyRegisteredModel:
    """An entry imported on first use."""

    def __init__(self, module_name: str, class_name: str) -> None:
        self.module_name, self.class_name = module_name, class_name
        self._info: _ModelInfo | None = None

    def load_model_cls(self) -> type[nn.Module]:
        return getattr(importlib.import_module(self.module_name), self.class_name)

    def inspect_model_cls(self) -> _ModelInfo:
        if self._info is None:
            self._info = _ModelInfo.from_model_cls(self.load_model_cls())
        return self._info

    @property
    def family(self) -> str:
        """The model file's name (`qwen2`, `commandr`): how the error lists architectures."""
        return self.module_name.rsplit(".", 1)[-1]

    def __repr__(self) -> str:
        return f"_LazyRegisteredModel({self.module_name}:{self.class_name})"


class _RegisteredModel:
    """An entry registered as a class object."""

    def __init__(self, model_cls: type[nn.Module]) -> None:
        self.model_cls = model_cls
        self._info = _ModelInfo.from_model_cls(model_cls)

    @property
    def family(self) -> str:
        return self.model_cls.__module__.rsplit(".", 1)[-1]

    def load_model_cls(self) -> type[nn.Module]:
        return self.model_cls

    def inspect_model_cls(self) -> _ModelInfo:
        return self._info


class _ModelRegistry:
    def __init__(self, models: dict[str, _LazyRegisteredModel | _RegisteredModel]) -> None:
        self.models = models

    def get_supported_archs(self) -> list[str]:
        return list(self.models)

    def register_model(self, model_arch: str, model_cls: type[nn.Module] | str) -> None:
        """Register (or replace) an architecture: an nn.Module subclass or a "module:Class" string."""
        if not isinstance(model_arch, str):
            raise TypeError(f"`model_arch` should be a string, not a {type(model_arch)}")
        if model_arch in self.models:
            logger.debug("Model architecture %s is already registered and will be overwritten "
                         "by the new model class %s.", model_arch, model_cls)
        if isinstance(model_cls, str):
            module_name, sep, class_name = model_cls.partition(":")
            if not sep or not module_name or not class_name or ":" in class_name:
                raise ValueError("Expected a string in the format <module>:<class>, "
                                 f"got {model_cls!r}")
            self.models[model_arch] = _LazyRegisteredModel(module_name, class_name)
        elif isinstance(model_cls, type) and issubclass(model_cls, nn.Module):
            self.models[model_arch] = _RegisteredModel(model_cls)
        else:
            raise TypeError("`model_cls` should be a string or an nn.Module subclass, "
                            f"not a {type(model_cls)}")

    def resolve_model_cls(self, architectures: str | list[str],
                          model_config: Any = None) -> tuple[type[nn.Module], str]:
        """The first registered architecture's class (adapted when the config converts it: then
        `XForSequenceClassification` / `XModel` may name the registered `XForCausalLM`)."""
        convert = getattr(model_config, "convert_type", "none")
        if convert in ("embed", "classify"):
            architectures = _with_causal_lm_names(architectures)
        cls, arch = self._first(architectures, lambda a: self._try_load_model_cls(a))
        if convert in ("embed", "classify"):
            cls = as_embedding_model(cls) if convert == "embed" else as_seq_cls_model(cls)
        return cls, arch

    def inspect_model_cls(self, architectures: str | list[str],
                          model_config: Any = None) -> tuple[_ModelInfo, str]:
        return self._first(architectures, lambda a: self._try_inspect_model_cls(a))

    def is_text_generation_model(self, architectures: str | list[str], model_config: Any = None) -> bool:
        return self.inspect_model_cls(architectures, model_config)[0].is_text_generation_model

    def is_pooling_model(self, architectures: str | list[str], model_config: Any = None) -> bool:
        return self.inspect_model_cls(architectures, model_config)[0].is_pooling_model

    def is_pp_supported_model(self, architectures: str | list[str], model_config: Any = None) -> bool:
        return self.inspect_model_cls(architectures, model_config)[0].supports_pp

    def is_hybrid_model(self, architectures: str | list[str], model_config: Any = None) -> bool:
        return self.inspect_model_cls(architectures, model_config)[0].is_hybrid

    def model_has_inner_state(self, architectures: str | list[str],
                              model_config: Any = None) -> bool:
        """Hybrid or attention-free models with per-sequence recurrent state."""
        info = self.inspect_model_cls(architectures, model_config)[0]
        return info.is_hybrid or info.has_inner_state

    def _try_load_model_cls(self, arch: str) -> type[nn.Module] | None:
        if arch not in self.models:
            return None
        try:
            return self.models[arch].load_model_cls()
        except Exception:
            logger.exception("Error in loading model architecture %r", arch)
            return None

    def _try_inspect_model_cls(self, arch: str) -> _ModelInfo | None:
        if arch not in self.models:
            return None
        try:
            return self.models[arch].inspect_model_cls()
        except Exception:
            logger.exception("Error in inspecting model architecture %r", arch)
            return None

    def _first(self, architectures: str | list[str], attempt: Callable[[str], Any]) -> tuple[Any, str]:
        archs = [architectures] if isinstance(architectures, str) else list(architectures)
        if not archs:
            raise ValueError("No model architectures are specified; the HF config's "
                             f"`architectures` is empty. {self._supported_by_family()}")
        for arch in archs:
            result = attempt(arch)
            if result is not None:
                return result, arch
        registered = [a for a in archs if a in self.models]
        if registered:
            raise ValueError(f"Model architectures {registered} failed to be inspected. "
                             "Please check the logs for more details.")
        raise ValueError(f"Model architectures {archs} are not supported for now. "
                         f"{self._supported_by_family()}")

    def _supported_by_family(self) -> str:
        """`Supported architectures, by model file: llama: A, B; qwen2: C, D; ...`."""
        families: dict[str, list[str]] = {}
        for arch, entry in self.models.items():
            families.setdefault(entry.family, []).append(arch)
        listed = "; ".join(f"{family}: {', '.join(sorted(archs, key=str.lower))}"
                           for family, archs in sorted(families.items()))
        return f"Supported architectures, by model file: {listed}"


ModelRegistry = _ModelRegistry({
    arch: _LazyRegisteredModel(f"{_MODELS_PACKAGE}.{module}", class_name)
    for arch, (module, class_name) in _VLLM_MODELS.items()
})


# Pooling suffixes whose causal-LM class, converted, is the model (vLLM's fallback).
_POOLING_SUFFIXES = ("ForSequenceClassification", "EmbeddingModel", "Model")


def _with_causal_lm_names(architectures: str | list[str]) -> list[str]:
    """Each name, then its `ForCausalLM` sibling when it ends in a pooling suffix."""
    names = []
    for arch in [architectures] if isinstance(architectures, str) else architectures:
        names.append(arch)
        suffix = next((s for s in _POOLING_SUFFIXES if arch.endswith(s)), None)
        if suffix is not None:
            names.append(arch[:-len(suffix)] + "ForCausalLM")
    return names
