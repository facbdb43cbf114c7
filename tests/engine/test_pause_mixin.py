"""AsyncLLM's pause / resume (vLLM's pause_generation / resume_generation / is_paused): in-flight
requests end with finish_reason "abort" and their partial output (or finish, when asked to wait);
requests sent while paused wait and then run as usual; the prefix cache is cleared unless told."""

import asyncio

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.sampling_params import SamplingParams
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

PROMPT = "the quick brown fox jumps over the lazy dog " * 3


@pytest.fixture(scope="module")
def async_llm(tmp_path_factory):
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("pause")))
    llm = AsyncLLM.from_engine_args(EngineArgs(model=path, dtype="float32", max_model_len=512,
                                               num_gpu_blocks_override=128))
    llm.start()
    yield llm
    llm.shutdown()


async def _final(llm: AsyncLLM, request_id: str, params: SamplingParams, seen=None):
    async for output in llm.add_request(request_id, PROMPT, params).outputs():
        if seen is not None and output.outputs[0].token_ids:
            seen.set()
    return output


def test_pause_aborts_in_flight_requests_and_holds_new_ones(async_llm):
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def scenario():
        started = asyncio.Event()
        running = [asyncio.create_task(_final(async_llm, f"long-{i}", long, started))
                   for i in range(2)]
        await started.wait()
        await async_llm.pause_generation()
        aborted = await asyncio.gather(*running)
        assert await async_llm.is_paused()
        held = asyncio.create_task(_final(async_llm, "held", short))
        await asyncio.sleep(0.3)
        assert not held.done()                       # waiting, not refused
        await async_llm.resume_generation()
        return aborted, await held

    aborted, held = asyncio.run(scenario())
    for output in aborted:
        assert output.finished and output.outputs[0].finish_reason == "abort"
        assert 0 < len(output.outputs[0].token_ids) < 400
    assert held.outputs[0].finish_reason == "length" and len(held.outputs[0].token_ids) == 6
    reference = asyncio.run(_final(async_llm, "again", short))
    assert reference.outputs[0].token_ids == held.outputs[0].token_ids


def test_pause_can_wait_for_in_flight_requests_and_keep_the_cache(async_llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def scenario():
        started = asyncio.Event()
        running = asyncio.create_task(_final(async_llm, "drained", params, started))
        await started.wait()
        await async_llm.pause_generation(wait_for_inflight_requests=True, clear_cache=False)
        assert running.done()                         # the pause returned after it finished
        await async_llm.resume_generation()
        cached = await _final(async_llm, "cached", params)
        await async_llm.pause_generation()            # clear_cache defaults to True
        await async_llm.resume_generation()
        return running.result(), cached, await _final(async_llm, "cleared", params)

    drained, cached, cleared = asyncio.run(scenario())
    assert drained.outputs[0].finish_reason == "length"
    assert len(drained.outputs[0].token_ids) == 40
    assert cached.num_cached_tokens > 0 and cleared.num_cached_tokens == 0
    assert not asyncio.run(async_llm.is_paused())
