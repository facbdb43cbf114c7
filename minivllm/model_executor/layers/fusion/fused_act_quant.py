"""vLLM's model-side hook that fuses an activation with the next linear's input quantization.

A quantized linear kernel that wants quantized inputs sets `_input_quant_key` and registers a
producer for `(activation class, key)`; with none registered (no such kernel yet) the hook is
exactly `act_fn(x)`. Not to be confused with `compilation/fusion.py`, the inductor pass that
folds a bf16 gate_up linear and SiluAndMul into one native call inside compiled graphs.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class QuantizedActivation:
    """An activation already quantized for the consuming linear's kernel."""

    data: torch.Tensor
    scale: torch.Tensor
    orig_dtype: torch.dtype
    orig_shape: torch.Size
    quant_key: Any


# (activation class, quant key) -> producer; a quantized kernel registers its own.
_PRODUCERS: dict[tuple[type, Any], Callable[[torch.nn.Module, torch.Tensor], QuantizedActivation]] = {}


def get_input_quant_key(linear: torch.nn.Module) -> Any:
    """The quantization the linear wants for its input, or None for plain activations."""
    if getattr(linear, "requires_unquantized_input", False):
        return None
    return getattr(linear, "_input_quant_key", None)


def maybe_fused_act_quant(act_fn: torch.nn.Module, x: torch.Tensor,
                          linear: torch.nn.Module) -> torch.Tensor | QuantizedActivation:
    """`act_fn(x)`, or its quantized form when a producer is registered for `linear`'s input key."""
    key = get_input_quant_key(linear)
    producer = _PRODUCERS.get((type(act_fn), key)) if key is not None else None
    return act_fn(x) if producer is None else producer(act_fn, x)
