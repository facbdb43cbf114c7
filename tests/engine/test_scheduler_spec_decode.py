"""The scheduler with draft tokens: drafts ride after the last token within the budget, the
KV of rejected drafts is taken back (the fake runner checks every cached position), caps and
preemption, and the acceptance counters."""

from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput
from tests.engine.test_scheduler import (FakeRunner, make_request, make_scheduler, prompt_of,
                                         run_to_completion, script_token)


class FakeSpecRunner(FakeRunner):
    """The scripted model, verifying drafts like the real runner (the KV of every position it
    runs, drafts included, is written; the scheduler must roll back what was rejected), and
    proposing drafts of which the first `num_right` are the script's next tokens."""

    def __init__(self, block_size: int, k: int = 3, num_right: int = 2):
        super().__init__(block_size)
        self.k, self.num_right = k, num_right

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.spec = so.scheduled_spec_decode_tokens
        out = super().execute(so)
        out.spec_token_ids = [self._propose(self.states[r]) if tokens else []
                              for r, tokens in zip(out.req_ids, out.sampled_token_ids)]
        return out

    def _propose(self, state) -> list[int]:
        n = len(state["tokens"])
        return [script_token(n + i) if i < self.num_right else 999 for i in range(self.k)]

    def _run_chunk(self, state, n):
        req_drafts = next((d for r, d in self.spec.items() if self.states.get(r) is state), [])
        if not req_drafts:
            return super()._run_chunk(state, n)
        tokens, start = state["tokens"], state["computed"]
        assert start + n == len(tokens) + len(req_drafts)
        for pos in range(start):
            assert self.kv.get(self._slot(state, pos)) == tokens[pos], "KV cache corrupted"
        for pos, token in zip(range(start, start + n), (tokens + req_drafts)[start:]):
            self.kv[self._slot(state, pos)] = token
        out = []
        for draft in req_drafts + [None]:
            target = script_token(len(tokens) + len(out))
            out.append(target)
            if draft != target:
                break
        tokens.extend(out)
        state["computed"] = len(tokens) - 1
        return out


def test_drafts_are_verified_and_rejected_kv_is_recomputed():
    s = make_scheduler(num_spec_tokens=3)
    runner = FakeSpecRunner(4, k=3, num_right=2)
    s.add_request(make_request("a", prompt_of(5), max_tokens=20))
    s.add_request(make_request("b", prompt_of(7, 50), max_tokens=20))
    finished, outputs = run_to_completion(s, runner)
    for req in finished.values():
        assert req.output_token_ids == [script_token(req.num_prompt_tokens + i)
                                        for i in range(20)]
    decode_steps = [so for so in outputs if so.scheduled_spec_decode_tokens]
    # After the prefill step, each step verifies 3 drafts (2 right) and yields 3 tokens.
    assert decode_steps[0].num_scheduled_tokens == {"a": 4, "b": 4}
    stats = s.spec_stats
    assert stats.num_accepted_tokens_per_pos[2] == 0
    assert stats.num_accepted_tokens == 2 * stats.num_drafts
    assert s.kv_cache_manager.num_free_blocks == 64


def test_drafts_stop_short_of_max_tokens_and_the_budget():
    s = make_scheduler(num_spec_tokens=3, max_num_batched_tokens=6)
    runner = FakeSpecRunner(4, k=3, num_right=3)
    s.add_request(make_request("a", prompt_of(3), max_tokens=6))
    s.add_request(make_request("b", prompt_of(3, 50), max_tokens=6))
    so = s.schedule()
    s.update_from_output(so, runner.execute(so))   # prefill: one token each, drafts of 3
    so = s.schedule()
    # a gets its token + 3 drafts; b the 2 tokens left of the budget (1 draft).
    assert so.num_scheduled_tokens == {"a": 4, "b": 2}
    assert so.scheduled_spec_decode_tokens == {"a": runner._propose(runner.states["a"]),
                                               "b": runner._propose(runner.states["b"])[:1]}
    s.update_from_output(so, runner.execute(so))
    a = s.requests["a"]
    assert a.num_output_tokens == 5
    # One token left to max_tokens: no drafts at all (the step yields the target's own token).
    assert a.spec_token_ids == []
    finished, _ = run_to_completion(s, runner)
    assert all(r.num_output_tokens == 6 for r in finished.values())


def test_drafts_stop_at_max_model_len():
    s = make_scheduler(num_spec_tokens=3, max_model_len=12)
    runner = FakeSpecRunner(4, k=3, num_right=0)   # every draft wrong
    s.add_request(make_request("a", prompt_of(8), max_tokens=50))
    finished, outputs = run_to_completion(s, runner)
    a = finished["a"]
    assert a.num_tokens == 12 and a.get_finished_reason() == "length"
    num_drafts = [len(d) for so in outputs for d in so.scheduled_spec_decode_tokens.values()]
    assert num_drafts == [3, 2, 1]   # positions 8..11, then 9..11, then 10..11: all < 12


def test_prefix_cache_registers_only_blocks_of_known_tokens():
    s = make_scheduler(num_spec_tokens=3)
    runner = FakeSpecRunner(4, k=3, num_right=0)
    s.add_request(make_request("a", prompt_of(6), max_tokens=50))
    so = s.schedule()
    s.update_from_output(so, runner.execute(so))   # 7 known tokens
    so = s.schedule()   # positions 6..9: the drafts fill block 1 (4..7) past the known tokens
    assert so.scheduled_spec_decode_tokens["a"] and so.num_scheduled_tokens["a"] == 4
    assert s.kv_cache_manager.num_cached_block["a"] == 1
    s.update_from_output(so, runner.execute(so))   # all rejected: 8 known tokens
    so = s.schedule()
    assert s.kv_cache_manager.num_cached_block["a"] == 2   # block 1 now holds verified tokens


def test_preemption_drops_drafts_and_the_request_resumes():
    s = make_scheduler(num_spec_tokens=3, num_blocks=6, max_model_len=24)
    runner = FakeSpecRunner(4, k=3, num_right=1)
    for i in range(3):
        s.add_request(make_request(f"r{i}", prompt_of(6, 30 * i), max_tokens=12))
    finished, outputs = run_to_completion(s, runner)
    assert s.num_preemptions_total > 0
    for req in finished.values():
        assert req.output_token_ids == [script_token(req.num_prompt_tokens + i)
                                        for i in range(12)]
    for so in outputs:   # a resumed request comes back without drafts
        for new in so.scheduled_new_reqs:
            assert new.req_id not in so.scheduled_spec_decode_tokens


def test_lookahead_slots_are_reserved_for_a_draft_model_up_to_max_model_len():
    s = make_scheduler(num_spec_tokens=3, num_lookahead_tokens=3, max_model_len=20)
    runner = FakeSpecRunner(4, k=3, num_right=3)
    s.add_request(make_request("a", prompt_of(7), max_tokens=40))
    so = s.schedule()
    # 7 prompt tokens + 3 lookahead slots: 10 positions, 3 blocks of 4
    assert len(so.scheduled_new_reqs[0].block_ids) == 3
    s.update_from_output(so, runner.execute(so))
    so = s.schedule()   # positions 7..10 (token + 3 drafts) + 3 lookahead: 14 -> 4 blocks
    assert len(s.kv_cache_manager.get_block_ids("a")) == 4
    s.update_from_output(so, runner.execute(so))
    finished, _ = run_to_completion(s, runner)
    # Never more blocks than max_model_len needs (20 tokens: 5 blocks).
    assert finished["a"].num_tokens == 20 and s.kv_cache_manager.num_free_blocks == 64
    assert s._lookahead(19) == 1 and s._lookahead(20) == 0 and s._lookahead(5) == 3
