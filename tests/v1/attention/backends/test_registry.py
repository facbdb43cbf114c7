"""`AttentionBackendEnum` (vLLM's backend registry names): CPU_ATTN resolves to minivllm's CPU
backend; GPU backends, MiMo-V2's DiffKV ones among them, are refused by name."""

import pytest

from minivllm.model_executor.layers.attention.backends import TorchAttentionBackend
from minivllm.v1.attention.backends.registry import AttentionBackendEnum


def test_cpu_backend_resolves_and_gpu_ones_are_named():
    assert AttentionBackendEnum.CPU_ATTN.get_class() is TorchAttentionBackend
    with pytest.raises(NotImplementedError, match="FLASH_ATTN_DIFFKV is not available.*CPU_ATTN"):
        AttentionBackendEnum.FLASH_ATTN_DIFFKV.get_class()
