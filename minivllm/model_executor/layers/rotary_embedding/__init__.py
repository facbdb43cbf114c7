"""Rotary embeddings: `get_rope` builds (once per argument key) the variant a config asks for."""

from typing import Any

import torch

from minivllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding, apply_rotary_emb
from minivllm.model_executor.layers.rotary_embedding.common import yarn_get_mscale
from minivllm.model_executor.layers.rotary_embedding.dynamic_ntk_scaling_rope import (
    DynamicNTKAlphaRotaryEmbedding, DynamicNTKScalingRotaryEmbedding)
from minivllm.model_executor.layers.rotary_embedding.gemma4_rope import Gemma4RotaryEmbedding
from minivllm.model_executor.layers.rotary_embedding.linear_scaling_rope import (
    LinearScalingRotaryEmbedding)
from minivllm.model_executor.layers.rotary_embedding.llama3_rope import Llama3RotaryEmbedding
from minivllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding
from minivllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
    Phi3LongRoPEScaledRotaryEmbedding, longrope_uses_long_factors)
from minivllm.model_executor.layers.rotary_embedding.yarn_scaling_rope import (
    YaRNScalingRotaryEmbedding)

__all__ = [
    "DynamicNTKAlphaRotaryEmbedding", "DynamicNTKScalingRotaryEmbedding", "Gemma4RotaryEmbedding",
    "LinearScalingRotaryEmbedding", "Llama3RotaryEmbedding", "MRotaryEmbedding",
    "Phi3LongRoPEScaledRotaryEmbedding",
    "RotaryEmbedding",
    "YaRNScalingRotaryEmbedding", "apply_rotary_emb", "get_rope",
]

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope",
                        "deepseek_yarn", "deepseek_llama_scaling", "proportional")
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")

# Every layer with the same arguments shares one module (and one cos/sin table).
_ROPE_DICT: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_size: int, max_position: int, is_neox_style: bool = True,
             rope_parameters: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
             dual_chunk_attention_config: dict[str, Any] | None = None,
             mrope_positions_factor: int = 4) -> RotaryEmbedding:
    """The shared RoPE module for these arguments; `rope_parameters` as in HF configs (v5)."""
    dtype = dtype or torch.get_default_dtype()
    params = dict(rope_parameters or {})
    rotary_dim = _rotary_dim(head_size, params)
    key = (head_size, rotary_dim, max_position, is_neox_style, _freeze(params),
           _freeze(dual_chunk_attention_config), dtype, mrope_positions_factor,
           _engine_choice(params, max_position))
    if key not in _ROPE_DICT:
        _check_supported(params, dual_chunk_attention_config)
        _ROPE_DICT[key] = _build_rope(head_size, rotary_dim, max_position, is_neox_style, params,
                                      dtype, mrope_positions_factor)
    return _ROPE_DICT[key]


def _build_rope(head_size: int, rotary_dim: int, max_position: int, is_neox_style: bool,
                params: dict[str, Any], dtype: torch.dtype,
                mrope_positions_factor: int = 4) -> RotaryEmbedding:
    base = params.get("rope_theta") or 10000
    rope_type = params.get("rope_type", params.get("type", "default"))
    common = (head_size, rotary_dim, max_position, base, is_neox_style)
    if rope_type == "default" and params.get("mrope_section"):
        # Qwen2-VL / Qwen2.5-VL (sectioned) and Qwen3-VL (interleaved): [T] or [3, T] positions.
        return MRotaryEmbedding(*common, dtype, mrope_section=list(params["mrope_section"]),
                                mrope_interleaved=bool(params.get("mrope_interleaved", False)),
                                positions_factor=mrope_positions_factor)
    if rope_type == "default":
        return RotaryEmbedding(*common, dtype)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(*common, params["factor"], dtype)
    if rope_type == "proportional":                 # Gemma 4's full-attention layers
        return Gemma4RotaryEmbedding(*common, dtype, params.get("factor", 1.0))
    if rope_type == "dynamic":
        if "alpha" in params:
            return DynamicNTKAlphaRotaryEmbedding(*common, params["alpha"], dtype)
        return DynamicNTKScalingRotaryEmbedding(*common, params["factor"], dtype,
                                                params.get("max_trained_positions"))
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(*common, dtype, params["factor"], params["low_freq_factor"],
                                     params["high_freq_factor"],
                                     params["original_max_position_embeddings"])
    if rope_type in ("deepseek_yarn", "deepseek_llama_scaling"):
        # vLLM's DeepSeek spelling of YaRN (its file renames the type): the cos/sin scale is
        # always mscale(factor, mscale) / mscale(factor, mscale_all_dim), defaults 1 and 0.
        factor = params["factor"]
        params = {**params, "attention_factor": (
            yarn_get_mscale(factor, params.get("mscale", 1.0))
            / yarn_get_mscale(factor, params.get("mscale_all_dim", 0.0)))}
        rope_type = "yarn"
    if rope_type == "yarn":
        original_max = params.get("original_max_position_embeddings") or max_position
        extra = {k: params[k] for k in _YARN_KEYS if params.get(k) is not None}
        return YaRNScalingRotaryEmbedding(head_size, rotary_dim, original_max, base,
                                          is_neox_style, params["factor"], dtype, **extra)
    if rope_type in ("longrope", "su"):
        return _build_longrope(head_size, rotary_dim, max_position, is_neox_style, params, dtype)
    raise ValueError(f"Unknown RoPE scaling type {rope_type!r}; supported types: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def _build_longrope(head_size: int, rotary_dim: int, max_position: int, is_neox_style: bool,
                    params: dict[str, Any], dtype: torch.dtype) -> RotaryEmbedding:
    missing = [k for k in ("short_factor", "long_factor") if not params.get(k)]
    if missing:
        raise ValueError(f"LongRoPE needs rope_parameters {missing} (one factor per rotated "
                         f"frequency), got keys {sorted(params)}")
    # transformers' `attention_factor` scales both tables unless vLLM's per-table mscales are set.
    attention_factor = params.get("attention_factor")
    return Phi3LongRoPEScaledRotaryEmbedding(
        head_size, rotary_dim, max_position,
        params.get("original_max_position_embeddings") or max_position,
        params.get("rope_theta") or 10000, is_neox_style, dtype, params["short_factor"],
        params["long_factor"], short_mscale=params.get("short_mscale", attention_factor),
        long_mscale=params.get("long_mscale", attention_factor),
        scaling_factor=params.get("factor"))


def _engine_choice(params: dict[str, Any], max_position: int) -> Any:
    """What besides the arguments shapes the module: LongRoPE's short/long choice (per engine)."""
    if params.get("rope_type", params.get("type")) not in ("longrope", "su"):
        return None
    original = params.get("original_max_position_embeddings") or max_position
    return longrope_uses_long_factors(original, max_position)


def _rotary_dim(head_size: int, params: dict[str, Any]) -> int:
    if params.get("rope_dim"):
        return int(params["rope_dim"])
    factor = params.get("partial_rotary_factor", 1.0)
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return int(head_size * factor)


def _check_supported(params: dict[str, Any], dual_chunk_attention_config: Any) -> None:
    if dual_chunk_attention_config is not None:
        raise NotImplementedError("Dual-chunk attention RoPE is not supported in minivllm")
    if params.get("use_fope"):
        raise NotImplementedError(f"RoPE with 'use_fope' (Fourier RoPE) is not supported; "
                                  f"supported types: {', '.join(SUPPORTED_ROPE_TYPES)}")
    # NOTE: as vLLM, `mrope_section` builds MRotaryEmbedding for the default type and is ignored
    # by the other scaled types but YaRN, whose multimodal variant minivllm lacks.
    if params.get("mrope_section") and params.get("rope_type", params.get("type")) == "yarn":
        raise NotImplementedError("M-RoPE ('mrope_section') with YaRN scaling is not supported; "
                                  "only the default rope_type")


def _freeze(value: Any) -> Any:
    """A hashable version of nested dicts/lists for the cache key."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value
