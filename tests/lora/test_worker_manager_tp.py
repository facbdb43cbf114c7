"""Adapters under tensor parallelism (real gloo worker processes): every rank reads the PEFT
folder and keeps its shard (column-parallel B by output rows per q / k / v and gate / up slice,
row-parallel A by input columns); the outputs equal one process's."""

import pytest
import torch

from minivllm import LLM
from minivllm.lora.request import LoRARequest
from tests.lora._lora_helpers import run

PROMPTS = [[5, 17, 300, 42, 7, 99, 3, 250, 11], [400, 8, 61, 2, 77], [9, 8, 7, 6, 5, 4, 3]]


def _outputs(lora_base, loras, tp: int):
    llm = LLM(lora_base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              block_size=4, num_gpu_blocks_override=64, max_model_len=64,
              tensor_parallel_size=tp)
    try:
        with pytest.raises(ValueError, match="No adapter_config.json"):   # the ranks keep serving
            llm.add_lora(LoRARequest("missing", 9, "/nonexistent/adapter"))
        # A mixed batch: two adapters and the base model.
        return run(llm, PROMPTS, loras), llm.list_loras()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_equals_one_process(lora_base, adapters, tp):
    # TP=4 > 2 KV heads: each rank holds a replicated KV head, so k/v B rows repeat.
    loras = [LoRARequest("all", 1, adapters["all"]), None, LoRARequest("rslora", 2, adapters["rslora"])]
    want, _ = _outputs(lora_base, loras, 1)
    got, listed = _outputs(lora_base, loras, tp)
    assert listed == {1, 2}
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        torch.testing.assert_close(logprobs, want_logprobs, atol=1e-4, rtol=0)
