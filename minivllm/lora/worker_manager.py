"""WorkerLoRAManager: a rank's adapters, loaded from their LoRARequest, and each step's mapping.

Every rank reads the PEFT folder itself and keeps its own shard of each adapter (the layers
narrow the full matrices), so nothing but the LoRARequest travels between processes. An
adapter evicted from the cache is read again from its path when a request needs it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from minivllm.config.lora import LoRAConfig
from minivllm.lora.model_manager import LoRAModelManager
from minivllm.lora.models import LoRAModel
from minivllm.lora.request import LoRARequest


class WorkerLoRAManager:
    def __init__(self, model: nn.Module, lora_config: LoRAConfig, model_dtype: torch.dtype) -> None:
        self.lora_config = lora_config
        self.manager = LoRAModelManager(model, lora_config, model_dtype)

    def load_adapter(self, lora_request: LoRARequest) -> LoRAModel:
        """Read and check the adapter (ValueError naming what is wrong)."""
        return LoRAModel.from_local_checkpoint(lora_request.lora_path, lora_request.lora_int_id,
                                               self.manager.targets, self.lora_config)

    def add_adapter(self, lora_request: LoRARequest, keep: Sequence[int] = ()) -> bool:
        if self.manager.has_adapter(lora_request.lora_int_id):
            return True
        self.manager.add_adapter(self.load_adapter(lora_request), keep)
        return True

    def remove_adapter(self, lora_id: int) -> bool:
        return self.manager.remove_adapter(lora_id)

    def list_adapters(self) -> set[int]:
        return self.manager.list_adapters()

    def set_active_adapters(self, row_loras: Sequence[LoRARequest | None],
                            query_lens: Sequence[int]) -> None:
        """Slots for this step's adapters and the per-token slot map.

        row_loras[b] is batch row b's adapter (None: base), query_lens[b] its token count.
        """
        requests = {r.lora_int_id: r for r in row_loras if r is not None}
        if not requests:
            # every slot -1, not "no mapping": the native LoRA calls still run, so a CPU graph
            # captured now also serves steps that do use adapters
            self.manager.set_mapping(torch.full((sum(query_lens),), -1, dtype=torch.int64))
            return
        ids = list(requests)
        for lora_request in requests.values():
            self.add_adapter(lora_request, keep=ids)   # reload if it was evicted
        slot_of = self.manager.activate(ids)
        row_slots = torch.tensor([slot_of[r.lora_int_id] if r is not None else -1
                                  for r in row_loras], dtype=torch.int64)
        token_slots = torch.repeat_interleave(row_slots,
                                              torch.tensor(query_lens, dtype=torch.int64))
        self.manager.set_mapping(token_slots)
