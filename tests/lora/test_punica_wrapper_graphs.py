"""LoRA decode steps as CPU graphs: the native LoRA call runs whatever the step's mapping holds
(no adapter: every slot -1) and reads the slot map from one fixed buffer, so a graph captured
in a base-model step replays later steps that mix adapters, equal to eager steps."""

import pytest
import torch

from minivllm import LLM
from minivllm.compilation.cpu_graph import CPUGraph, refuse_capture
from minivllm.lora.request import LoRARequest
from tests.lora._lora_helpers import run

pytestmark = pytest.mark.requires_native
PROMPTS = [[5, 17, 300, 42, 7, 99, 3, 250, 11], [400, 8, 61, 2, 77]]


def _engine(lora_base, mode: str) -> LLM:
    return LLM(lora_base, dtype="bfloat16", enable_lora=True, max_lora_rank=16, max_loras=2,
               block_size=4, num_gpu_blocks_override=128, max_model_len=64,
               compilation_config={"cudagraph_mode": mode})


def test_graphs_captured_without_adapters_replay_steps_with_them(lora_base, adapters):
    loras = [LoRARequest("attn", 1, adapters["attn"]), LoRARequest("all", 2, adapters["all"])]
    eager, graphs = _engine(lora_base, "NONE"), _engine(lora_base, "FULL_DECODE_ONLY")
    try:
        runner = graphs.llm_engine.executor.worker.model_runner.cpu_graphs
        assert runner.enabled
        for llm in (eager, graphs):                  # base-model steps first: captures
            run(llm, PROMPTS)
        assert 2 in runner.entries, runner.refused     # both prompts decode together
        before = runner.num_replays
        for requests in ([loras[0], loras[1]], [None, loras[1]], [loras[0], None]):
            want = run(eager, PROMPTS, requests)
            got = run(graphs, PROMPTS, requests)
            for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
                assert tokens == want_tokens
                assert torch.equal(lps, want_lps)
        assert runner.num_replays > before           # the adapters' steps were replayed
        base = run(eager, PROMPTS)
        assert run(eager, PROMPTS, loras)[0][0] != base[0][0]   # and they do change the output
    finally:
        eager.shutdown()
        graphs.shutdown()


def test_refuse_capture_refuses_only_a_running_capture():
    refuse_capture("outside any capture: nothing happens")
    graph = CPUGraph()
    with graph.capture():
        refuse_capture("LoRA through torch ops")
    assert not graph.ok and graph.refused == "LoRA through torch ops"
