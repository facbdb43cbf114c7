"""AsyncLLM as vLLM's asyncio callers drive it (`from vllm import AsyncLLMEngine,
AsyncEngineArgs`): `generate(prompt, sampling_params, request_id, ...)` honours
`RequestOutputKind` (cumulative, deltas, final only) and `await engine.abort(...)` ends a
stream being read with its output so far (finish_reason "abort")."""

import asyncio

import pytest

import minivllm
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("async_generate")))
    engine = minivllm.AsyncLLMEngine.from_engine_args(minivllm.AsyncEngineArgs(
        model=path, dtype="float32", max_model_len=128, num_gpu_blocks_override=32))
    engine.start()
    yield engine
    engine.shutdown()


async def _collect(engine, kind: RequestOutputKind, request_id: str, n: int = 1) -> list:
    params = SamplingParams(temperature=0.8, seed=5, n=n, max_tokens=12, ignore_eos=True,
                            logprobs=1, output_kind=kind)
    return [out async for out in engine.generate(PROMPT, params, request_id)]


def test_output_kinds(engine):
    async def scenario():
        return [await _collect(engine, kind, f"kind-{kind.name}", n=2)
                for kind in RequestOutputKind]

    cumulative, delta, final_only = asyncio.run(scenario())
    final = cumulative[-1]
    assert final.finished and len(cumulative) > 1
    assert len(final_only) == 1 and final_only[0].finished
    assert [o.token_ids for o in final_only[0].outputs] == [o.token_ids for o in final.outputs]
    assert len(delta) > 1
    for index in range(2):        # each completion's deltas add up to its whole
        parts = [c for out in delta for c in out.outputs if c.index == index]
        whole = next(c for c in final.outputs if c.index == index)
        assert "".join(p.text for p in parts) == whole.text
        assert [t for p in parts for t in p.token_ids] == whole.token_ids
        assert sum(len(p.logprobs) for p in parts) == len(whole.logprobs)
        assert parts[-1].finish_reason == "length"


def test_abort_can_be_awaited_and_priority_reaches_the_engine(engine):
    async def scenario():
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        gen = engine.generate(PROMPT, params, "to-abort")
        first = await gen.__anext__()
        await engine.abort("to-abort")
        await engine.abort(["unknown-a", "unknown-b"])    # unknown ids are ignored
        rest = [out async for out in gen]
        return first, rest, engine.num_requests

    first, rest, left = asyncio.run(scenario())
    assert not first.finished and left == 0
    final = rest[-1]     # the stream ends with the request's output so far, marked "abort"
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert 0 < len(final.outputs[0].token_ids) < 100
    with pytest.raises(ValueError, match="needs priority scheduling"):
        asyncio.run(_collect_priority(engine))


async def _collect_priority(engine) -> None:
    async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=2), "urgent", priority=1):
        pass


def test_engine_client_queries(engine):
    """vLLM's EngineClient surface custom servers read."""
    tokenizer = asyncio.run(engine.get_tokenizer())
    assert tokenizer("hello").input_ids
    assert engine.model_config.max_model_len == 128
    assert engine.is_running and not engine.errored
    with pytest.raises(ValueError, match="LoRA is disabled"):
        asyncio.run(engine.list_loras())


def test_encode_pools_as_the_offline_engine(tmp_path):
    """vLLM's `AsyncLLM.encode` on a pooling model: the embedding LLM.embed gives."""
    import torch

    from minivllm import LLM
    from minivllm.pooling_params import PoolingParams

    path = write_tiny_checkpoint(str(tmp_path / "embed"))
    kwargs = dict(model=path, dtype="float32", max_model_len=64, runner="pooling",
                  convert="embed", num_gpu_blocks_override=16)
    engine = minivllm.AsyncLLMEngine.from_engine_args(minivllm.AsyncEngineArgs(**kwargs))
    engine.start()

    async def scenario():
        return [out async for out in engine.encode(PROMPT, PoolingParams(), "embed-1")]

    try:
        (output,) = asyncio.run(scenario())
    finally:
        engine.shutdown()
    (expected,) = LLM(**kwargs).embed([PROMPT], use_tqdm=False)
    assert output.finished
    torch.testing.assert_close(output.outputs.data, torch.tensor(expected.outputs.embedding))
