"""LLMEngine.from_engine_args: the one way every entry point builds an engine."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine

PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def engine_args(path: str, **kwargs) -> EngineArgs:
    return EngineArgs(model=path, dtype="float32", block_size=4, num_gpu_blocks_override=64,
                      max_model_len=128, **kwargs)


def test_from_engine_args_builds_a_working_engine(tiny_llama_factory):
    path = tiny_llama_factory()
    engine = LLMEngine.from_engine_args(engine_args(path, long_prefill_token_threshold=2))
    assert engine.vllm_config.model_config.model == path
    assert engine.executor.num_blocks == 64
    assert engine.scheduler.long_prefill_token_threshold == 2
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, PARAMS)
    outputs = engine.run_until_finished(["0", "1"])
    assert [o.request_id for o in outputs] == ["0", "1"]
    assert all(o.finished and len(o.outputs[0].token_ids) == 5 for o in outputs)
    engine.shutdown()
    engine.shutdown()   # idempotent

    llm = LLM(model=path, dtype="float32", block_size=4, num_gpu_blocks_override=64, max_model_len=128)
    assert isinstance(llm.llm_engine, LLMEngine) and llm.executor is llm.llm_engine.executor
    assert llm.vllm_config is llm.llm_engine.vllm_config and llm.tokenizer is llm.llm_engine.tokenizer
    assert llm.engine_args == engine_args(path)
    same = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in same] == [o.outputs[0].token_ids for o in outputs]


def test_run_until_finished_reports_every_output_and_aborts_on_error(tiny_llama_factory):
    engine = LLMEngine.from_engine_args(engine_args(tiny_llama_factory()))
    seen = []
    engine.add_request("a", PROMPTS[0], PARAMS)
    engine.run_until_finished(["a"], seen.append)
    assert len(seen) == 5 and seen[-1].finished and not any(o.finished for o in seen[:-1])

    def fail(output):
        raise KeyboardInterrupt

    engine.add_request("b", PROMPTS[1], PARAMS)
    with pytest.raises(KeyboardInterrupt):
        engine.run_until_finished(["b"], fail)
    assert not engine.has_unfinished_requests()
    engine.shutdown()


def test_llm_rejects_unknown_arguments_before_loading():
    with pytest.raises(ValueError, match=r"Unknown engine argument\(s\) enforce_eagre"):
        LLM(enforce_eagre=True)
