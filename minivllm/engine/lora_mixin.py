"""LLMEngine's adapter registry (vLLM's add_lora / remove_lora / list_loras): the engine keeps
which adapter each id names, every worker rank keeps the weights (through the executor)."""

from __future__ import annotations

from typing import Any

from minivllm.lora.request import LoRARequest


class LoRAMixin:
    """Needs `lora_config` (None: LoRA disabled), `executor` and `_lora_requests` (id -> the
    adapter registered with add_lora or by a request's first use)."""

    lora_config: Any
    executor: Any
    _lora_requests: dict[int, LoRARequest]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter on every worker rank (ValueError naming the problem if it cannot
        be read or does not fit the model); True once it is ready. Idempotent per id."""
        self._check_lora_enabled()
        known = self._lora_requests.get(lora_request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora_request.lora_name, lora_request.lora_path):
                raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already adapter "
                                 f"{known.lora_name!r} ({known.lora_path}); give "
                                 f"{lora_request.lora_name!r} another id")
            return True
        if not lora_request.lora_path:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} has no lora_path; give "
                             "the folder holding adapter_config.json")
        self.executor.add_lora(lora_request)
        self._lora_requests[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter (its ranks' copies too); False when it was not loaded."""
        self._check_lora_enabled()
        known = self._lora_requests.pop(lora_id, None)
        removed = self.executor.remove_lora(lora_id)
        return known is not None or bool(removed)

    def list_loras(self) -> set[int]:
        """Ids of the adapters added and not removed."""
        self._check_lora_enabled()
        return set(self._lora_requests)

    def _check_lora_enabled(self) -> None:
        if self.lora_config is None:
            raise ValueError("LoRA is disabled for this engine: create it with enable_lora=True "
                             "(`--enable-lora`; `--max-loras`, `--max-lora-rank` size the "
                             "adapter slots)")
