"""`Scheduler(whole_prefills=True)` (models with prefix-LM attention): a prefill is scheduled
whole or waits, prefix caching is off, and a budget that could never hold a prompt is refused."""

import pytest

from minivllm.engine.sched_utils import has_prefix_lm_layers
from tests.engine.test_scheduler import (FakeRunner, make_request, make_scheduler, prompt_of,
                                         run_to_completion, script_token)


def test_prefills_run_whole_or_wait():
    s = make_scheduler(max_num_batched_tokens=64, whole_prefills=True)
    for i, n in enumerate([30, 40, 20, 25]):
        s.add_request(make_request(f"r{i}", prompt_of(n, 100 * i), max_tokens=5))
    finished, outputs = run_to_completion(s, FakeRunner(4))
    assert set(finished) == {"r0", "r1", "r2", "r3"}
    for req in finished.values():
        assert req.output_token_ids == [script_token(req.num_prompt_tokens + i) for i in range(5)]
    prompt_lens = {"r0": 30, "r1": 40, "r2": 20, "r3": 25}
    for so in outputs:                  # every scheduled prefill is a whole prompt
        for new in so.scheduled_new_reqs:
            assert so.num_scheduled_tokens[new.req_id] == prompt_lens[new.req_id]
    # r1's 40 tokens do not fit beside r0's 30: it waits a step (and r2, behind it, too), where
    # the default scheduler would have split it.
    assert outputs[0].num_scheduled_tokens == {"r0": 30}
    assert outputs[1].num_scheduled_tokens == {"r0": 1, "r1": 40, "r2": 20}
    default = make_scheduler(max_num_batched_tokens=64)
    for i, n in enumerate([30, 40]):
        default.add_request(make_request(f"r{i}", prompt_of(n, 100 * i)))
    assert default.schedule().num_scheduled_tokens == {"r0": 30, "r1": 34}


def test_prefix_caching_is_turned_off():
    s = make_scheduler(max_num_batched_tokens=64, whole_prefills=True, enable_prefix_caching=True)
    assert not s.kv_cache_manager.enable_caching
    s.add_request(make_request("a", prompt_of(20)))
    run_to_completion(s, FakeRunner(4))
    s.add_request(make_request("b", prompt_of(20)))       # same prompt: no prefix hit
    assert s.schedule().num_scheduled_tokens == {"b": 20}


def test_a_budget_below_max_model_len_is_refused():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be at least "
                                         r"max_model_len \(64\)"):
        make_scheduler(whole_prefills=True)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8,
                       whole_prefills=True)


def test_has_prefix_lm_layers_reads_the_registered_layers():
    class Layer:
        def __init__(self, non_causal: bool) -> None:
            self.non_causal = non_causal

    class Config:
        class compilation_config:  # noqa: N801 (stands in for the config's attribute)
            static_forward_context = {"a": Layer(False)}

    assert not has_prefix_lm_layers(Config)
    Config.compilation_config.static_forward_context["b"] = Layer(True)
    assert has_prefix_lm_layers(Config)
    assert not has_prefix_lm_layers(object())
