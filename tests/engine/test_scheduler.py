"""Scheduler with a fake runner that simulates the paged KV cache and checks every read."""

import pytest

from minivllm.engine.request import Request, RequestStatus
from minivllm.engine.scheduler import Scheduler
from minivllm.sampling_params import SamplingParams
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput

EOS = 1


def script_token(pos: int) -> int:
    """The fake model's next token depends only on the position, never EOS by itself."""
    return 10 + (pos * 7) % 50


class FakeRunner:
    """Keeps per-request state from the deltas like the real runner, and a slot -> token map
    standing in for the KV cache: each chunk first checks that every earlier position of its
    request is in the slots its block table names (so shared or reused blocks are caught)."""

    def __init__(self, block_size: int, script=script_token):
        self.block_size = block_size
        self.script = script
        self.states: dict[str, dict] = {}
        self.kv: dict[int, int] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.states[new.req_id] = dict(tokens=new.prompt_token_ids + new.output_token_ids,
                                           computed=new.num_computed_tokens, blocks=list(new.block_ids))
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            state = self.states[req_id]
            assert state["computed"] == num_computed
            state["blocks"] += new_blocks
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            req_ids.append(req_id)
            sampled.append(self._run_chunk(self.states[req_id], n))
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _slot(self, state, pos):
        return state["blocks"][pos // self.block_size] * self.block_size + pos % self.block_size

    def _run_chunk(self, state, n):
        start, tokens = state["computed"], state["tokens"]
        assert start + n <= len(tokens) and len(state["blocks"]) * self.block_size >= start + n
        for pos in range(start):
            assert self.kv.get(self._slot(state, pos)) == tokens[pos], "KV cache corrupted"
        for pos in range(start, start + n):
            self.kv[self._slot(state, pos)] = tokens[pos]
        state["computed"] = start + n
        if start + n < len(tokens):
            return []
        token = self.script(len(tokens))
        tokens.append(token)
        return [token]


def make_scheduler(**overrides):
    kwargs = dict(max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_blocks=64,
                  max_model_len=64)
    kwargs.update(overrides)
    return Scheduler(**kwargs)


def make_request(req_id, prompt, **params):
    params.setdefault("max_tokens", 4)
    return Request(req_id, prompt, SamplingParams(**params), eos_token_id=EOS)


def run_to_completion(scheduler, runner, max_steps=500, on_step=None):
    finished, outputs = {}, []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        assert so.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= scheduler.max_num_seqs
        outputs.append(so)
        for req in scheduler.update_from_output(so, runner.execute(so)):
            if req.is_finished:
                finished[req.request_id] = req
        if on_step:
            on_step(so)
    assert not scheduler.has_unfinished_requests()
    return finished, outputs


def prompt_of(n, offset=0):
    return [100 + offset + i for i in range(n)]


def test_budget_chunked_prefill_and_every_request_finishes():
    s = make_scheduler()
    for i, n in enumerate([40, 10, 5, 23]):
        s.add_request(make_request(f"r{i}", prompt_of(n, 100 * i), max_tokens=6))
    finished, outputs = run_to_completion(s, FakeRunner(4))
    assert set(finished) == {"r0", "r1", "r2", "r3"}
    for req in finished.values():
        assert req.num_output_tokens == 6 and req.get_finished_reason() == "length"
        assert req.output_token_ids == [script_token(req.num_prompt_tokens + i) for i in range(6)]
    # r0's 40-token prompt is split over three steps of at most 16 tokens.
    assert [so.num_scheduled_tokens["r0"] for so in outputs[:3]] == [16, 16, 8]
    assert s.kv_cache_manager.num_free_blocks == 64


def test_decodes_go_first_then_a_prefill_chunk_fills_the_budget():
    s = make_scheduler()
    runner = FakeRunner(4)
    s.add_request(make_request("a", prompt_of(5), max_tokens=10))
    so = s.schedule()
    s.update_from_output(so, runner.execute(so))
    s.add_request(make_request("b", prompt_of(30, 50)))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    s.update_from_output(so, runner.execute(so))
    so = s.schedule()   # b continues as a cached request
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert so.scheduled_cached_reqs.num_computed_tokens == [6, 15]


def test_max_num_seqs_and_long_prefill_threshold():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    runner = FakeRunner(4)
    for i in range(3):
        s.add_request(make_request(f"r{i}", prompt_of(20, 30 * i)))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"r0": 8, "r1": 8} and s.num_waiting == 1
    s.update_from_output(so, runner.execute(so))
    finished, outputs = run_to_completion(s, runner)
    assert len(finished) == 3
    assert all(len(so.num_scheduled_tokens) <= 2 for so in outputs)


def test_preemption_by_recompute_loses_nothing():
    # 3 requests x (8 prompt + 10 output) tokens need 15 blocks of 4; only 6 exist.
    s = make_scheduler(num_blocks=6, max_model_len=24)
    for i in range(3):
        s.add_request(make_request(f"r{i}", prompt_of(8, 20 * i), max_tokens=10))
    preempted = set()
    finished, outputs = run_to_completion(
        s, FakeRunner(4), on_step=lambda so: preempted.update(so.preempted_req_ids))
    assert preempted and "r0" not in preempted   # the last-arrived requests are the victims
    assert sum(r.num_preemptions for r in finished.values()) >= 1
    for req in finished.values():
        assert req.output_token_ids == [script_token(8 + i) for i in range(10)]
    resumed = [new for so in outputs for new in so.scheduled_new_reqs if new.output_token_ids]
    assert resumed, "a preempted request must come back with its generated tokens"
    assert s.kv_cache_manager.num_free_blocks == 6


def test_preempted_request_goes_back_to_the_front_of_the_queue():
    s = make_scheduler(num_blocks=4, max_model_len=16, max_num_batched_tokens=32)
    runner = FakeRunner(4)
    s.add_request(make_request("a", prompt_of(8), max_tokens=8))
    s.add_request(make_request("b", prompt_of(8, 50), max_tokens=8))
    s.add_request(make_request("c", prompt_of(2, 90), max_tokens=2))
    so = s.schedule()   # a and b take all 4 blocks; c waits
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    s.update_from_output(so, runner.execute(so))
    so = s.schedule()   # a needs a 3rd block: b is preempted, nothing is admitted
    assert so.preempted_req_ids == {"b"} and set(so.num_scheduled_tokens) == {"a"}
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0


def test_prefix_cache_hit_on_admission():
    s = make_scheduler()
    runner = FakeRunner(4)
    shared = prompt_of(16)
    s.add_request(make_request("a", shared + [7, 8, 9]))
    run_to_completion(s, runner)
    s.add_request(make_request("b", shared + [5, 6]))
    so = s.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 16 and so.num_scheduled_tokens["b"] == 2
    assert s.requests["b"].num_cached_tokens == 16
    s.update_from_output(so, runner.execute(so))
    run_to_completion(s, runner)   # the fake runner checked the cached KV it read


def test_no_prefix_hits_when_disabled():
    s = make_scheduler(enable_prefix_caching=False)
    runner = FakeRunner(4)
    s.add_request(make_request("a", prompt_of(16)))
    run_to_completion(s, runner)
    s.add_request(make_request("b", prompt_of(16)))
    assert s.schedule().scheduled_new_reqs[0].num_computed_tokens == 0


def test_abort_frees_blocks_and_is_reported_once():
    s = make_scheduler()
    runner = FakeRunner(4)
    s.add_request(make_request("a", prompt_of(10), max_tokens=50))
    s.add_request(make_request("w", prompt_of(10, 40)))
    so = s.schedule()
    s.update_from_output(so, runner.execute(so))
    s.finish_requests(["a", "w", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == 64 and not s.has_unfinished_requests()
    s.add_request(make_request("c", prompt_of(3, 80)))
    so = s.schedule()
    assert so.finished_req_ids == {"a", "w"}
    s.update_from_output(so, runner.execute(so))
    assert s.schedule().finished_req_ids == set()


def test_output_of_an_aborted_request_is_ignored():
    s = make_scheduler()
    runner = FakeRunner(4)
    s.add_request(make_request("a", prompt_of(3)))
    so = s.schedule()
    out = runner.execute(so)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.update_from_output(so, out) == []


def step_until_finished(s, runner, req_id):
    while True:
        so = s.schedule()
        for req in s.update_from_output(so, runner.execute(so)):
            if req.request_id == req_id and req.is_finished:
                return req


@pytest.mark.parametrize("params, script, n_out, reason, stop_reason", [
    (dict(), lambda pos: EOS, 1, "stop", None),
    (dict(min_tokens=3), lambda pos: EOS, 3, "stop", None),
    (dict(ignore_eos=True, max_tokens=5), lambda pos: EOS, 5, "length", None),
    (dict(stop_token_ids=[42]), lambda pos: 42 if pos == 6 else 3, 3, "stop", 42),
    (dict(max_tokens=None), lambda pos: 3, 14, "length", None),   # max_model_len=18
])
def test_token_level_stop_conditions(params, script, n_out, reason, stop_reason):
    s = make_scheduler(max_model_len=18)
    s.add_request(make_request("a", prompt_of(4), **{"max_tokens": 16, **params}))
    req = step_until_finished(s, FakeRunner(4, script), "a")
    assert req.num_output_tokens == n_out
    assert req.get_finished_reason() == reason and req.stop_reason == stop_reason


def test_kv_cache_must_hold_max_model_len():
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(num_blocks=2, block_size=4, max_model_len=9)
