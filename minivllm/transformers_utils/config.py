"""Loading Hugging Face configs (folders and GGUF files) and normalising their RoPE fields."""

import os
from typing import Any

from transformers import AutoConfig, PretrainedConfig

# GGUF metadata names no architecture; map llama.cpp's model_type to the HF class name.
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def is_gguf(model: str) -> bool:
    return os.path.isfile(model) and model.endswith(".gguf")


def get_config(model: str) -> PretrainedConfig:
    """Read the HF config of a checkpoint folder or of a `.gguf` file's metadata."""
    if is_gguf(model):
        config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(model)),
                                            gguf_file=os.path.basename(model))
        if not getattr(config, "architectures", None):
            arch = _GGUF_ARCHS.get(config.model_type)
            config.architectures = [arch] if arch else [config.model_type]
    elif os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"{model!r} has no config.json; pass a HF checkpoint folder or a .gguf file")
        config = AutoConfig.from_pretrained(model)
    else:
        raise ValueError(f"Model path {model!r} is neither a folder nor a .gguf file "
                         "(minivllm never downloads from a hub)")
    patch_rope_parameters(config)
    return config


def patch_rope_parameters(config: PretrainedConfig) -> None:
    """Deliver `config.rope_parameters` (with `rope_theta` inside) as vLLM does (contract §7.3)."""
    for cfg in _configs_to_patch(config):
        _patch_one(cfg)


def _configs_to_patch(config: PretrainedConfig) -> list[PretrainedConfig]:
    configs = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        configs.append(text)
    return configs


def _patch_one(cfg: PretrainedConfig) -> None:
    # Legacy attribute names used by older checkpoints.
    if getattr(cfg, "rotary_emb_base", None) is not None and getattr(cfg, "rope_theta", None) is None:
        cfg.rope_theta = cfg.rotary_emb_base
    rope: dict[str, Any] | None = getattr(cfg, "rope_parameters", None)
    if rope is None:
        rope = getattr(cfg, "rope_scaling", None)
    rope = dict(rope) if rope else {}
    if "type" in rope:
        legacy = rope.pop("type")
        if "rope_type" in rope and rope["rope_type"] != legacy:
            raise ValueError(f"rope_parameters has conflicting 'type'={legacy!r} and "
                             f"'rope_type'={rope['rope_type']!r}")
        rope["rope_type"] = legacy
    rope_type = rope.get("rope_type", "default")
    rope["rope_type"] = {"su": "longrope", "mrope": "default"}.get(rope_type, rope_type)
    if "rope_theta" not in rope and getattr(cfg, "rope_theta", None) is not None:
        rope["rope_theta"] = cfg.rope_theta
    for legacy_name in ("partial_rotary_factor", "rotary_pct"):
        value = getattr(cfg, legacy_name, None)
        if value is not None and "partial_rotary_factor" not in rope:
            rope["partial_rotary_factor"] = value
    if rope.get("partial_rotary_factor") == 1.0:
        rope.pop("partial_rotary_factor")
    cfg.rope_parameters = rope if rope.get("rope_theta") is not None or len(rope) > 1 else None


def set_default_rope_theta(config: PretrainedConfig, default_theta: float) -> None:
    """Qwen's default: make sure `rope_parameters` exists and carries a theta."""
    if getattr(config, "rope_parameters", None) is None:
        config.rope_parameters = {"rope_type": "default"}
    if "rope_theta" not in config.rope_parameters:
        config.rope_parameters["rope_theta"] = default_theta
