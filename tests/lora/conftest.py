"""Module-scoped tiny Llama + adapters shared by the LoRA tests."""

import pytest

from tests.lora._lora_helpers import ALL_LINEAR, ATTENTION, QV_REGEX, write_adapter


@pytest.fixture(scope="session")
def lora_base(tiny_llama_factory) -> str:
    return tiny_llama_factory("lora_base")


@pytest.fixture(scope="session")
def adapters(lora_base, tmp_path_factory) -> dict[str, str]:
    """name -> PEFT folder: attention-only, all-linear, rsLoRA with a regex target, and a
    fourth all-linear one with another rank."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": write_adapter(lora_base, str(root / "attn"), 1, ATTENTION),
        "all": write_adapter(lora_base, str(root / "all"), 2, ALL_LINEAR),
        "rslora": write_adapter(lora_base, str(root / "rslora"), 3, QV_REGEX, r=16,
                                alpha=8, use_rslora=True),
        "r4": write_adapter(lora_base, str(root / "r4"), 4, ALL_LINEAR, r=4, alpha=4),
    }
