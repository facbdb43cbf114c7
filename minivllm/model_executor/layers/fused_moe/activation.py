"""MoE expert activations by name (vLLM 0.33's `fused_moe.activation`): gated ones read an
expert's first GEMM output [n, 2I] as gate and up halves, non-gated ones ("*_no_mul", as
Nemotron-H's relu2 experts) apply the function to [n, I] alone, the expert having no up rows."""

import torch
import torch.nn.functional as F

# Gated: "swigluoai" reads gate/up rows interleaved, as gpt-oss checkpoints store them; every
# other one (its "swigluoai_uninterleave" too) gate rows first.
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "swigluoai_uninterleave")
NON_GATED_ACTIVATIONS = ("silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul", "relu2_no_mul")
MOE_ACTIVATIONS = GATED_ACTIVATIONS + NON_GATED_ACTIVATIONS
# transformers' names vLLM accepts for its own.
_ALIASES = {"gelu_pytorch_tanh": "gelu_tanh"}


def activation_without_mul(activation: str) -> str:
    """The non-gated variant of an activation name: "relu2" -> "relu2_no_mul" (a name already
    without the multiply is returned as it is). vLLM's model files pass it to the experts."""
    name = _ALIASES.get(activation, activation)
    if name in NON_GATED_ACTIVATIONS:
        return name
    variant = f"{name}_no_mul"
    if variant not in NON_GATED_ACTIVATIONS:
        bases = ", ".join(a.removesuffix("_no_mul") for a in NON_GATED_ACTIVATIONS)
        raise ValueError(f"MoE activation {activation!r} has no non-gated variant; choose one "
                         f"of {bases}")
    return variant


def is_gated(activation: str) -> bool:
    """Whether the experts' first GEMM yields gate and up halves (w13 holds 2I rows) or I rows."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"Unsupported MoE activation {activation!r}; choose one of "
                         f"{', '.join(MOE_ACTIVATIONS)}")
    return activation in GATED_ACTIVATIONS


def apply_activation_no_mul(h: torch.Tensor, activation: str) -> torch.Tensor:
    """A non-gated expert activation of [n, I] -> [n, I]."""
    if activation == "silu_no_mul":
        return F.silu(h)
    if activation == "gelu_no_mul":
        return F.gelu(h)
    if activation == "gelu_tanh_no_mul":
        return F.gelu(h, approximate="tanh")
    if activation == "relu2_no_mul":
        return torch.square(F.relu(h))
    raise ValueError(f"Unsupported non-gated MoE activation {activation!r}; choose one of "
                     f"{', '.join(NON_GATED_ACTIVATIONS)}")
