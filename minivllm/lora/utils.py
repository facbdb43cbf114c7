"""LoRATargets: which transformers module names an adapter may target in this model, and the
LoRA layer (plus packed slice) each one lands in.

A model's LoRA layers have vLLM's module paths (`model.layers.0.self_attn.qkv_proj`); an
adapter trained with PEFT on the transformers model names the unfused modules
(`...self_attn.q_proj`). The model's `packed_modules_mapping` (`qkv_proj: [q_proj, k_proj,
v_proj]`) gives the slice: the position of the name in that list.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from minivllm.model_executor.models.placeholders import PPMissingLayer


class LoRATargets:
    NOT_ON_THIS_RANK: Any = object()   # a layer another pipeline stage holds

    def __init__(self, model: nn.Module, lora_modules: dict[str, Any]) -> None:
        self.model = model
        self.lora_modules = lora_modules
        self.packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}))
        # transformers-side names of every module an adapter can adapt here
        self.hf_module_names: list[str] = []
        for name in lora_modules:
            parent, _, last = name.rpartition(".")
            for sub in self.packed.get(last, [last]):
                self.hf_module_names.append(f"{parent}.{sub}" if parent else sub)
        self.valid_target_names: list[str] = sorted(
            {n.rpartition(".")[2] for n in self.hf_module_names})

    def resolve(self, hf_module: str) -> tuple[str, int | None] | Any | None:
        """(LoRA layer path, slice index; None = the whole fused matrix), NOT_ON_THIS_RANK,
        or None when the model has no LoRA layer for the name."""
        layer = self.lora_modules.get(hf_module)
        if layer is not None:
            return hf_module, (0 if layer.num_slices == 1 else None)
        parent, _, last = hf_module.rpartition(".")
        for packed_name, subs in self.packed.items():
            if last in subs:
                name = f"{parent}.{packed_name}" if parent else packed_name
                if name in self.lora_modules:
                    return name, subs.index(last)
        return self.NOT_ON_THIS_RANK if self._on_other_stage(hf_module) else None

    def check_target_modules(self, peft: Any) -> None:
        """One error for every `target_modules` entry that matches no adaptable module."""
        targets = peft.target_modules
        valid = ", ".join(self.valid_target_names)
        if isinstance(targets, str):
            if targets == "all-linear" or any(re.fullmatch(targets, n)
                                              for n in self.hf_module_names):
                return
            raise ValueError(f"LoRA target_modules regex {targets!r} matches no module of this "
                             f"model; valid target modules: {valid}")
        unmatched = [t for t in targets
                     if not any(n == t or n.endswith("." + t) for n in self.hf_module_names)]
        if unmatched:
            raise ValueError(f"LoRA target_modules {unmatched} match no module of this model "
                             f"that LoRA can adapt; valid target modules: {valid}")

    def _on_other_stage(self, hf_module: str) -> bool:
        module: nn.Module = self.model
        for part in hf_module.split("."):
            if isinstance(module, PPMissingLayer):
                return True
            module = getattr(module, part, None) if not part.isdigit() else _child(module, part)
            if module is None:
                return False
        return isinstance(module, PPMissingLayer)


def _child(module: nn.Module, index: str) -> nn.Module | None:
    try:
        return module[int(index)]          # ModuleList
    except (TypeError, IndexError, KeyError):
        return getattr(module, index, None)


def replace_submodule(model: nn.Module, module_name: str, new_module: nn.Module) -> None:
    parent_name, _, attr = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new_module)
