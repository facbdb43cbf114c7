"""The served models: the base model and its LoRA adapters (vLLM's `OpenAIServingModels`).

`--lora-modules` adapters are loaded when the server starts; with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` set, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`
add and remove adapters while it runs. A request's `model` picks the base model or an adapter.
"""

from __future__ import annotations

import os
from http import HTTPStatus

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.cli_args import LoRAModulePath
from minivllm.entrypoints.openai.protocol import ModelCard, ModelList, OpenAIBaseModel
from minivllm.entrypoints.openai.serving_engine import OpenAIError
from minivllm.lora.request import LoRARequest


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str | None = None
    lora_int_id: int | None = None


class OpenAIServingModels:
    """Which names a request's `model` may take, and the adapter each one means."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str | list[str],
                 lora_modules: list[LoRAModulePath] | None = None) -> None:
        """`served_model_name`: the base model's name, or its names (vLLM's
        `--served-model-name a b`: requests may use any, responses name the first)."""
        self.async_llm = async_llm
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        if not names or not all(names):
            raise ValueError("--served-model-name needs at least one non-empty name.")
        self.served_model_names = names
        self.served_model_name = names[0]
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_lora_id = 1

    async def init_static_loras(self) -> None:
        """Loads the `--lora-modules` adapters (a bad one stops the server from starting)."""
        for module in self.static_lora_modules:
            await self._load(module.name, module.path, module.base_model_name)

    def is_base_model(self, model: str | None) -> bool:
        return model is None or model in (*self.served_model_names, self.async_llm.model_path)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); a 404 naming the
        available models otherwise."""
        if self.is_base_model(model):
            return None
        if model in self.lora_requests:
            return self.lora_requests[model]
        available = ", ".join(f"`{name}`" for name in [*self.served_model_names, *self.lora_requests])
        raise OpenAIError(f"The model `{model}` does not exist; available models: {available}.",
                          HTTPStatus.NOT_FOUND, "model")

    def show_available_models(self) -> ModelList:
        max_model_len = self.async_llm.max_model_len
        cards = [ModelCard(id=name, root=self.async_llm.model_path, max_model_len=max_model_len)
                 for name in self.served_model_names]
        cards += [ModelCard(id=name, root=lora.lora_path,
                            parent=lora.base_model_name or self.served_model_name,
                            max_model_len=max_model_len)
                  for name, lora in self.lora_requests.items()]
        return ModelList(data=cards)

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        if not request.lora_name or not request.lora_path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.",
                              param="lora_name" if not request.lora_name else "lora_path")
        if request.lora_name in self.lora_requests or self.is_base_model(request.lora_name):
            raise OpenAIError(f"The lora adapter '{request.lora_name}' has already been loaded.",
                              param="lora_name")
        await self._load(request.lora_name, request.lora_path, None)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        if not request.lora_name:
            raise OpenAIError("'lora_name' must be provided.", param="lora_name")
        lora = self.lora_requests.get(request.lora_name)
        if lora is None or (request.lora_int_id is not None and request.lora_int_id != lora.lora_int_id):
            raise OpenAIError(f"The lora adapter '{request.lora_name}' cannot be found.",
                              HTTPStatus.NOT_FOUND, "lora_name")
        await self.async_llm.remove_lora(lora.lora_int_id)
        del self.lora_requests[request.lora_name]
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    async def _load(self, name: str, path: str, base_model_name: str | None) -> None:
        """Loads the adapter on the engine's thread; a bad folder or config is a 4xx."""
        if not os.path.isdir(path):
            raise OpenAIError(f"No adapter found at lora_path {path!r} (for '{name}'): give a "
                              "folder holding adapter_config.json.", HTTPStatus.NOT_FOUND,
                              "lora_path")
        # NOTE: the id is taken before the await, so concurrent loads never share one.
        lora = LoRARequest(lora_name=name, lora_int_id=self._next_lora_id, lora_path=path,
                           base_model_name=base_model_name)
        self._next_lora_id += 1
        try:
            await self.async_llm.add_lora(lora)
        except (ValueError, OSError, KeyError) as exc:   # unreadable or unfitting adapter
            raise OpenAIError(f"Failed to load LoRA adapter '{name}': {exc}", param="lora_path") from exc
        self.lora_requests[name] = lora
