"""The KV-cache budget: --kv-cache-memory-bytes, else vLLM's VLLM_CPU_KVCACHE_SPACE (GiB) on CPU,
else 1 GiB; the blocks are the budget over one block's bytes in every attention layer."""

import pytest

from minivllm import LLM
from tests.entrypoints.openai._helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("kv_budget")))


def _blocks(path: str, **kwargs) -> tuple[int, int]:
    """(blocks, bytes per block) of an fp32 LLM on the tiny checkpoint."""
    llm = LLM(model=path, dtype="float32", max_model_len=64, **kwargs)
    try:
        per_block = llm.llm_engine.executor.worker.model_runner.kv_cache_bytes_per_block()
        return llm.llm_engine.executor.num_blocks, per_block
    finally:
        llm.shutdown()


def test_cpu_kvcache_space_sets_the_budget(path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.0625")          # 64 MiB
    blocks, per_block = _blocks(path)
    assert blocks == (64 << 20) // per_block
    # the flag wins over the variable
    blocks, _ = _blocks(path, kv_cache_memory_bytes=per_block * 7)
    assert blocks == 7
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")               # vLLM's "auto": the default
    assert _blocks(path)[0] == (1 << 30) // per_block


def test_a_bad_cpu_kvcache_space_names_the_variable(path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a non-negative number "
                                         "of GiB, got 'lots'"):
        LLM(model=path, dtype="float32", max_model_len=64)
