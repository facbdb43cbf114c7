"""The model runner publishes each step's BatchDescriptor in the forward context (vLLM's field):
uniform only for decode-only steps, which the GGUF linears read to pick their int8 kernels; the
CPU graphs capture decode steps under the same descriptor."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.forward_context import get_forward_context, is_decode_only_step


@pytest.mark.parametrize("mode", ["NONE", "FULL_DECODE_ONLY"])
def test_steps_carry_their_batch_descriptor(tiny_llama_factory, mode):
    llm = LLM(tiny_llama_factory(), dtype="bfloat16", max_model_len=64,
              compilation_config={"cudagraph_mode": mode})
    seen = []

    def record(module, args, kwargs):
        batch = get_forward_context().batch_descriptor
        seen.append((batch.num_tokens, batch.num_reqs, batch.uniform, is_decode_only_step()))

    model = llm.llm_engine.executor.worker.model_runner.model
    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        llm.generate([[5, 6, 7, 8, 9], [10, 11, 12]], SamplingParams(temperature=0, max_tokens=3))
    finally:
        hook.remove()
        llm.shutdown()
    assert seen[0] == (8, 2, False, False)                # both prompts in one step
    assert (2, 2, True, True) in seen                     # decode steps (eager, or the capture)
    assert not is_decode_only_step()                      # no step: no forward context
