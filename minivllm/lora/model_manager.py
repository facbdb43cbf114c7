"""LoRAModelManager: wraps a built model's linears and keeps the slot table and the adapter cache.

Two levels, as vLLM's LRU managers:
  * `max_cpu_loras` loaded adapters (`LoRAModel`, full-size CPU tensors), least recently used
    evicted first;
  * `max_loras` slots in every LoRA layer's tables. A step's adapters are written into slots
    before its forward (`activate`), evicting the least recently used slot that this step does
    not need. The scheduler never puts more than `max_loras` adapters into one step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from minivllm.config.lora import LoRAConfig
from minivllm.logger import init_logger
from minivllm.lora.layers import BaseLinearLayerWithLoRA, from_layer
from minivllm.lora.models import LoRAModel
from minivllm.lora.punica_wrapper import PunicaWrapper
from minivllm.lora.utils import LoRATargets, replace_submodule
from minivllm.model_executor.models.interfaces import supports_lora

logger = init_logger(__name__)


class LoRAModelManager:
    def __init__(self, model: nn.Module, lora_config: LoRAConfig, model_dtype: torch.dtype) -> None:
        if not supports_lora(model):
            raise ValueError(f"{type(model).__name__} does not support LoRA (it does not "
                             "implement SupportsLoRA with packed_modules_mapping); run it "
                             "without --enable-lora")
        self.model = model
        self.lora_config = lora_config
        self.max_loras = lora_config.max_loras
        self.dtype = lora_config.resolve_dtype(model_dtype)
        self.punica_wrapper = PunicaWrapper(self.max_loras, self.dtype)
        self.modules: dict[str, BaseLinearLayerWithLoRA] = self._wrap_layers()
        self.targets = LoRATargets(model, self.modules)
        self._cache: OrderedDict[int, LoRAModel] = OrderedDict()   # LRU: oldest first
        self._slot_of: OrderedDict[int, int] = OrderedDict()       # lora id -> slot, LRU order
        logger.info("LoRA: %d layers wrapped, %d slots of rank %d, %d cached adapters",
                    len(self.modules), self.max_loras, lora_config.max_lora_rank,
                    lora_config.max_cpu_loras)

    def _wrap_layers(self) -> dict[str, BaseLinearLayerWithLoRA]:
        skip = tuple(getattr(self.model, "lora_skip_prefixes", []))
        # A layer held at several places (MLA's wrapper holds the projections its block built)
        # is replaced at every one, so each caller runs the LoRA layer.
        paths: dict[int, list[str]] = {}
        for name, module in self.model.named_modules(remove_duplicate=False):
            paths.setdefault(id(module), []).append(name)
        wrapped = {}
        for name, module in list(self.model.named_modules()):
            # A layer whose weight is used other than through its forward (MLA absorbs
            # kv_b_proj's) cannot carry a LoRA delta: it is no target (an adapter naming it
            # gets the list of valid targets).
            if (skip and name.startswith(skip)) or getattr(module, "lora_unsupported", None):
                continue
            lora_layer = from_layer(module)
            if lora_layer is None:
                continue
            lora_layer.create_lora_weights(self.max_loras, self.lora_config.max_lora_rank,
                                           self.dtype, self.punica_wrapper)
            for path in paths[id(module)]:
                replace_submodule(self.model, path, lora_layer)
            wrapped[name] = lora_layer
        if not wrapped:
            raise ValueError(f"{type(self.model).__name__} has no layer LoRA can wrap")
        return wrapped

    # --- the adapter cache ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.lora_config.max_cpu_loras

    def list_adapters(self) -> set[int]:
        return set(self._cache)

    def has_adapter(self, lora_id: int) -> bool:
        return lora_id in self._cache

    def add_adapter(self, lora: LoRAModel, keep: Iterable[int] = ()) -> None:
        """Cache `lora`, evicting the least recently used adapter not in `keep`."""
        if lora.id in self._cache:
            self._cache.move_to_end(lora.id)
            return
        keep = set(keep)
        while len(self._cache) >= self.capacity:
            victim = next((i for i in self._cache if i not in keep), None)
            if victim is None:
                raise RuntimeError(f"all {self.capacity} cached adapters are needed by this "
                                   "step; raise max_cpu_loras")
            self.remove_adapter(victim)
        self._cache[lora.id] = lora

    def remove_adapter(self, lora_id: int) -> bool:
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            for module in self.modules.values():
                module.reset_lora(slot)
        return self._cache.pop(lora_id, None) is not None

    # --- slots ---------------------------------------------------------------------------

    def activate(self, lora_ids: list[int]) -> dict[int, int]:
        """Give each of the step's adapters (all cached) a slot; lora id -> slot."""
        if len(lora_ids) > self.max_loras:
            raise RuntimeError(f"{len(lora_ids)} adapters in one step, more than max_loras "
                               f"{self.max_loras} (the scheduler should prevent this)")
        needed = set(lora_ids)
        for lora_id in lora_ids:
            self._cache.move_to_end(lora_id)
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            slot = self._free_slot(needed)
            lora = self._cache[lora_id]
            for name, module in self.modules.items():
                module.set_lora(slot, lora.loras.get(name, [None] * module.num_slices))
            self._slot_of[lora_id] = slot
        return {i: self._slot_of[i] for i in lora_ids}

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(i for i in self._slot_of if i not in needed)
        return self._slot_of.pop(victim)

    def set_mapping(self, token_slots: torch.Tensor | None) -> None:
        """This step's token -> slot map ([T] int64, -1 = base); None: every token is base."""
        if token_slots is None:
            self.punica_wrapper.clear()
        else:
            self.punica_wrapper.update(token_slots)
