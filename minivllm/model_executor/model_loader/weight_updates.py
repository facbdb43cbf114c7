"""Weights loaded into a live model: vLLM's RLHF pattern, where a trainer pushes new weights
with `model.load_weights([(name, tensor), ...])` (through a worker extension,
`LLM.collective_rpc` or `apply_model`) or asks for `reload_weights`.

After the first load, layers may hold tensors derived from their weights (a bf16 linear keeps a
oneDNN-packed copy for prompt-sized GEMMs; quantized methods repack or quantize the
checkpoint's tensors). A later `load_weights` writes the plain weights only, so the derived
copies would silently serve the old values: `allow_weight_updates` wraps the model's
`load_weights` to refresh them for the layers it loaded, and refuses (before writing anything)
on models whose layers cannot take checkpoint-format tensors again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from minivllm.model_executor.layers.quantization.unquantized import (UnquantizedEmbeddingMethod,
                                                                     UnquantizedLinearMethod)

# Methods whose derived state `process_weights_after_loading` rebuilds from the plain weight.
_REFRESHABLE = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
Weights = Iterable[tuple[str, torch.Tensor]]


def allow_weight_updates(model: nn.Module) -> None:
    """Makes later `model.load_weights(weights)` calls safe (see the module docstring)."""
    first_load: Callable[[Weights], set[str] | None] = model.load_weights
    blockers = _update_blockers(model)
    modules = dict(model.named_modules())

    def load_weights(weights: Weights) -> set[str] | None:
        if blockers:
            raise ValueError(
                "Weights cannot be loaded into this running model: "
                f"{', '.join(blockers[:3])}{' ...' if len(blockers) > 3 else ''} derive their "
                "tensors from the checkpoint's once, at load time. Start an engine on the new "
                "checkpoint instead (LLM.sleep(level=2) + wake_up() reloads its own).")
        loaded = first_load(weights)
        refresh_derived_weights(modules, loaded)
        return loaded

    model.load_weights = load_weights


def refresh_derived_weights(modules: dict[str, nn.Module], loaded: set[str] | None) -> int:
    """Rebuilds the derived tensors of the layers owning the `loaded` parameter names (every
    refreshable layer when the loader returned no names); returns how many were rebuilt."""
    if loaded is None:
        owners = list(modules.values())
    else:
        owners = [modules.get(name.rpartition(".")[0]) for name in loaded]
    count, seen = 0, set()
    for module in owners:
        method = getattr(module, "quant_method", None)
        if isinstance(method, _REFRESHABLE) and id(module) not in seen:
            seen.add(id(module))
            method.process_weights_after_loading(module)
            count += 1
    return count


def _update_blockers(model: nn.Module) -> list[str]:
    """'<Method> (<layer>)' for each layer whose weights a second load cannot reach, and the
    model itself when it post-processes its weights as a whole (MLA's absorbed matrices)."""
    blockers = [f"{type(m.quant_method).__name__} ({name})"
                for name, m in model.named_modules()
                if getattr(m, "quant_method", None) is not None
                and not isinstance(m.quant_method, _REFRESHABLE)]
    if callable(getattr(model, "process_weights_after_loading", None)):
        blockers.append(f"{type(model).__name__}.process_weights_after_loading")
    return blockers
