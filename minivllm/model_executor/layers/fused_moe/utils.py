"""Fused shared experts (vLLM 0.33's `fused_moe.utils`): whether a MoE layer packs its shared
experts into the routed grouped GEMM. vLLM does that only with ROCm AITER kernels, which minivllm
has none of (`_aiter_ops`): every layer keeps its shared experts as their own module."""

from collections.abc import Iterable

from torch import nn

from minivllm._aiter_ops import rocm_aiter_ops
from minivllm.model_executor.models.placeholders import PPMissingLayer


def resolve_layer_fused_shared_expert(quant_config: object, prefix: str,
                                      shared_expert_name: str = "shared_experts",
                                      moe_backend: str | None = None) -> bool:
    """Whether the layer at `prefix` fuses its shared experts: only when AITER asks for it."""
    return bool(rocm_aiter_ops.is_fusion_moe_shared_experts_enabled())


def is_model_fused_shared_expert_compatible(layers: nn.ModuleList | Iterable[nn.Module],
                                            moe_cls: type[nn.Module], moe_name: str) -> bool:
    """One answer for the whole model: True when every `moe_cls` layer (found at the dotted
    `moe_name` under each decoder layer) fuses, False when none does; a mix raises."""
    enabled = []
    for layer in layers:
        if isinstance(layer, PPMissingLayer):
            continue
        moe = layer
        for part in moe_name.split("."):
            moe = getattr(moe, part, None)
        if isinstance(moe, moe_cls):
            enabled.append(bool(getattr(moe, "is_fused_shared_expert_enabled", False)))
    if any(enabled) and not all(enabled):
        raise NotImplementedError(f"fused shared experts must be enabled for all MoE layers; "
                                  f"{sum(enabled)} of {len(enabled)} are")
    return bool(enabled) and all(enabled)
