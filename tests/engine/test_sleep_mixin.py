"""Sleep mode (vLLM's LLM.sleep / wake_up with enable_sleep_mode=True): level 1 lets go of the
KV cache, level 2 of the weights too (nothing keeps them alive); after waking the engine gives
the same tokens, adapters and draft heads included."""

import gc
import weakref

import pytest

from minivllm import LLM, SamplingParams
from minivllm.lora.request import LoRARequest
from tests.entrypoints.openai._helpers import write_tiny_checkpoint

PROMPTS = ["the quick brown fox jumps over the lazy dog", "Hello world hello", "abc abc"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("sleep")))


def _llm(path: str, **kwargs) -> LLM:
    return LLM(model=path, dtype="float32", max_model_len=128, num_gpu_blocks_override=32,
               enable_sleep_mode=True, **kwargs)


def _tokens(llm: LLM, **kwargs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids)
            for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, **kwargs)]


def test_level_1_frees_the_kv_cache_and_keeps_the_weights(checkpoint):
    llm = _llm(checkpoint)
    runner = llm.llm_engine.executor.worker.model_runner
    expected, model = _tokens(llm), runner.model
    caches = [weakref.ref(layer.kv_cache) for layer in runner.attn_layers.values()]
    llm.sleep(level=1)
    gc.collect()
    assert llm.llm_engine.is_sleeping()
    assert all(layer.kv_cache.numel() == 0 for layer in runner.attn_layers.values())
    assert all(cache() is None for cache in caches)        # nothing keeps the old caches
    with pytest.raises(ValueError, match=r"asleep \(sleep level 1: kv_cache released\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.llm_engine.is_sleeping() and runner.model is model
    assert _tokens(llm) == expected


def test_level_2_drops_the_weights_and_reloads_them(checkpoint):
    llm = _llm(checkpoint)
    runner = llm.llm_engine.executor.worker.model_runner
    expected = _tokens(llm)
    weight = weakref.ref(runner.model.lm_head.weight)
    llm.sleep(level=2)
    gc.collect()
    assert weight() is None and runner.model is None      # nothing holds the old weights
    with pytest.raises(ValueError, match="needs the weights awake first"):
        llm.wake_up(tags=["kv_cache"])
    llm.wake_up(tags=["weights"])
    assert llm.llm_engine.is_sleeping()                   # the cache is still asleep
    llm.wake_up(tags=["kv_cache"])
    assert _tokens(llm) == expected


def test_adapters_and_eagle_heads_come_back_after_level_2(checkpoint, tmp_path):
    from tests.lora._lora_helpers import ALL_LINEAR, write_adapter
    from tests.worker._eagle_heads import write_aligned_head, write_eagle_target

    target = write_eagle_target(str(tmp_path / "target"))
    adapter = LoRARequest("a", 1, write_adapter(target, str(tmp_path / "adapter"), 2,
                                                ALL_LINEAR))
    llm = _llm(target, enable_lora=True, max_lora_rank=8, speculative_config={
        "method": "eagle", "model": write_aligned_head(str(tmp_path / "head"), target),
        "num_speculative_tokens": 3})
    expected = _tokens(llm, lora_request=adapter)
    llm.sleep(level=2)
    llm.wake_up()
    stats = llm.llm_engine.scheduler.spec_stats
    accepted = stats.num_accepted_tokens
    assert _tokens(llm, lora_request=adapter) == expected
    assert llm.llm_engine.list_loras() == {1}
    assert stats.num_accepted_tokens > accepted            # the rebuilt head drafts well


def test_sleep_errors_name_the_problem(checkpoint):
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        LLM(model=checkpoint, dtype="float32", max_model_len=64).sleep()
    llm = _llm(checkpoint)
    with pytest.raises(ValueError, match=r"sleep level must be one of \(1, 2\), got 3"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="wake_up tags must be among"):
        llm.wake_up(tags=["memory"])
    llm.llm_engine.add_request("running", "hello", GREEDY)
    with pytest.raises(ValueError, match="1 unfinished request"):
        llm.sleep()
    llm.llm_engine.abort_request(["running"])
    llm.sleep()
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep(level=2)


@pytest.mark.slow
def test_worker_processes_sleep_and_wake_up(checkpoint):
    """TP=2: each worker process frees and takes back its own shard."""
    llm = _llm(checkpoint, tensor_parallel_size=2)
    expected = _tokens(llm)
    for level in (1, 2):
        llm.sleep(level=level)
        llm.wake_up()
        assert _tokens(llm) == expected
    llm.shutdown()
