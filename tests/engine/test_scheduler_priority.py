"""--scheduling-policy priority: waiting requests are admitted by (priority, arrival), the
running ones served in that order, and the least urgent running request is the one preempted
(fake runner, as in test_scheduler.py); an engine refuses a priority under fcfs."""

from types import SimpleNamespace

import pytest

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.request import Request
from minivllm.sampling_params import SamplingParams
from tests.engine.test_llm_engine import make_engine
from tests.engine.test_scheduler import (EOS, FakeRunner, make_scheduler, prompt_of,
                                         run_to_completion, script_token)


def _request(req_id, prompt, priority, arrival, max_tokens=4):
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=EOS,
                   arrival_time=arrival, priority=priority)


def _admission_order(outputs):
    return [new.req_id for so in outputs for new in so.scheduled_new_reqs
            if not new.output_token_ids]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    for req_id, priority, arrival in (("a", 5, 0.0), ("b", 0, 1.0), ("c", 0, 2.0), ("d", 1, 3.0)):
        s.add_request(_request(req_id, prompt_of(6, ord(req_id)), priority, arrival))
    finished, outputs = run_to_completion(s, FakeRunner(4))
    assert _admission_order(outputs) == ["b", "c", "d", "a"]
    fcfs = make_scheduler(max_num_seqs=1)
    for req_id, priority, arrival in (("a", 5, 0.0), ("b", 0, 1.0)):
        fcfs.add_request(_request(req_id, prompt_of(6, ord(req_id)), priority, arrival))
    assert _admission_order(run_to_completion(fcfs, FakeRunner(4))[1]) == ["a", "b"]


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "urgent")])
def test_the_least_urgent_running_request_is_preempted(policy, victim):
    # Both fit at first (4 blocks of 4 tokens); the first to need a third block evicts one.
    s = make_scheduler(policy=policy, num_blocks=4, max_model_len=16, max_num_batched_tokens=32)
    s.add_request(_request("low", prompt_of(8), 9, 0.0, max_tokens=8))
    s.add_request(_request("urgent", prompt_of(8, 50), 0, 1.0, max_tokens=8))
    preempted = []
    finished, _ = run_to_completion(s, FakeRunner(4),
                                    on_step=lambda so: preempted.extend(so.preempted_req_ids))
    assert preempted and set(preempted) == {victim}
    for req in finished.values():   # recompute loses nothing
        assert req.output_token_ids == [script_token(8 + i) for i in range(8)]


def test_an_engine_serves_priorities_in_order_and_refuses_them_under_fcfs(tokenizer):
    engine, executor = make_engine(tokenizer)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2), priority=1)
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=1, max_num_batched_tokens=8,
                                         policy="priority"),
        cache_config=SimpleNamespace(block_size=4, enable_prefix_caching=True),
        model_config=SimpleNamespace(max_model_len=64))
    engine = LLMEngine(config, executor, tokenizer)
    for req_id, priority in (("late", 3), ("first", -1), ("second", 0)):
        engine.add_request(req_id, [5, 6, 7], SamplingParams(max_tokens=2), priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    assert order == ["first", "second", "late"]
