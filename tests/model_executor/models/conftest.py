"""Fixtures of the model-family tests."""

import pytest

from minivllm.model_executor.models.registry import ModelRegistry
from tests.model_executor.models._vllm_files import load_vllm_class


@pytest.fixture
def registered_vllm_class():
    """Registers vLLM's class for an architecture, restoring minivllm's afterwards."""
    saved = {}

    def register(file: str, arch: str, cls_name: str | None) -> type:
        cls = load_vllm_class(file, cls_name or arch)
        saved.setdefault(arch, ModelRegistry.models.get(arch))
        ModelRegistry.register_model(arch, cls)
        return cls
    yield register
    for arch, entry in saved.items():
        if entry is None:
            ModelRegistry.models.pop(arch, None)
        else:
            ModelRegistry.models[arch] = entry
