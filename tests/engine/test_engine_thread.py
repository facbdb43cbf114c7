"""AsyncLLM builds its engine on the thread that steps it (one OpenMP pool per process), and the
EngineThread that hosts both."""

from __future__ import annotations

import asyncio
import threading

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.engine_thread import EngineThread
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from tests.entrypoints.openai._helpers import write_tiny_checkpoint


def test_calls_run_in_order_on_one_thread_and_errors_reach_the_caller():
    host = EngineThread(name="test-engine-thread")
    seen: list[tuple[int, int]] = []
    futures = [host.submit(lambda i=i: seen.append((i, threading.get_ident())) or i)
               for i in range(5)]
    assert [f.result(timeout=5) for f in futures] == list(range(5))
    assert [i for i, _ in seen] == list(range(5))
    assert {ident for _, ident in seen} == {host.thread.ident}
    assert host.thread.ident != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        host.call(lambda: 1 / 0)
    assert host.call(lambda: "still serving") == "still serving"   # an error ends no thread
    host.close()
    host.thread.join(timeout=5)
    assert not host.thread.is_alive()


def test_async_llm_builds_and_steps_the_engine_on_its_loop_thread(tmp_path, monkeypatch):
    build_threads: list[int] = []
    step_threads: set[int] = set()
    build, step = LLMEngine.from_engine_args.__func__, LLMEngine.step

    def recording_build(cls, engine_args):
        build_threads.append(threading.get_ident())
        return build(cls, engine_args)

    def recording_step(self):
        step_threads.add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(recording_build))
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    checkpoint = write_tiny_checkpoint(str(tmp_path / "tiny"))
    async_llm = AsyncLLM.from_engine_args(EngineArgs(
        model=checkpoint, dtype="float32", max_model_len=128, num_gpu_blocks_override=32))
    try:
        async_llm.start()

        async def generate() -> list[int]:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            outputs = [o async for o in async_llm.generate([1, 5, 9, 13], params, "r0")]
            return list(outputs[-1].outputs[0].token_ids)

        assert len(asyncio.run(generate())) == 4
        loop_thread = async_llm._thread
        assert loop_thread is not None and loop_thread.is_alive()
        # Built and stepped on the loop thread, never on this (the server's main) thread.
        assert build_threads == [loop_thread.ident]
        assert step_threads == {loop_thread.ident}
        assert threading.get_ident() not in step_threads
    finally:
        async_llm.shutdown()
    assert not loop_thread.is_alive()
    assert async_llm.check_health() is not None   # stopped: /health reports it


def test_a_failed_build_raises_in_the_caller_and_ends_its_thread(tmp_path):
    before = set(threading.enumerate())
    with pytest.raises(Exception) as info:
        AsyncLLM.from_engine_args(EngineArgs(model=str(tmp_path / "missing"), dtype="float32"))
    assert "missing" in str(info.value)
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=5)
        assert not thread.is_alive(), f"{thread.name} outlived the failed build"
