"""The scheduler: one token budget per step shared by decodes and (chunked) prefills."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.request import Request, RequestStatus
from minivllm.engine.sched_utils import check_stop
from minivllm.logger import init_logger
from minivllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.v1.spec_decode.metrics import SpecDecodingStats

logger = init_logger(__name__)


class Scheduler:
    """Decides each step which tokens of which requests the model computes.

    There are no prefill and decode phases: every request simply has `num_tokens -
    num_computed_tokens` tokens to catch up on. Running requests are served first (in arrival
    order), then waiting ones are admitted while budget, sequence slots and blocks last. When
    blocks run out, the last-arrived running request is preempted by recompute.

    `policy="priority"` (vLLM's): the waiting and the running requests are kept ordered by
    (priority, arrival), lower first, so the most urgent are served first and the least urgent
    running request is the one preempted.
    """

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                 num_blocks: int, max_model_len: int, enable_prefix_caching: bool = True,
                 long_prefill_token_threshold: int = 0, max_loras: int | None = None,
                 whole_prefills: bool = False, policy: str = "fcfs",
                 num_spec_tokens: int = 0, num_lookahead_tokens: int = 0) -> None:
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if num_blocks * block_size < max_model_len:
            # NOTE: otherwise one long request could preempt itself forever.
            raise ValueError(
                f"The KV cache holds {num_blocks} blocks x {block_size} tokens = "
                f"{num_blocks * block_size} tokens, fewer than max_model_len={max_model_len}; "
                f"lower max_model_len or give the cache more blocks.")
        if whole_prefills and (max_num_batched_tokens < max_model_len
                               or long_prefill_token_threshold):
            raise ValueError(
                "This model's prefills must run whole (prefix-LM attention: a prompt attends "
                "bidirectionally within its step), so max_num_batched_tokens "
                f"({max_num_batched_tokens}) must be at least max_model_len ({max_model_len}) "
                f"and long_prefill_token_threshold ({long_prefill_token_threshold}) 0; raise "
                "the first or lower max_model_len.")
        # True: a waiting request's prefill is scheduled whole or waits (vLLM with chunked
        # prefill off); its running requests then never have prefill tokens left.
        self.whole_prefills = whole_prefills
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # LoRA: at most this many distinct adapters among the running requests (the workers'
        # slot table); None when LoRA is off.
        self.max_loras = max_loras
        if whole_prefills and enable_prefix_caching:
            # A prompt started from cached blocks would miss its bidirectional prefill (vLLM
            # turns prefix caching off for such models too).
            logger.info("Prefix caching is off: the model has prefix-LM attention layers")
            enable_prefix_caching = False
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0          # counter for metrics and tests
        # Finished since the last schedule(): sent once so the runner drops their state.
        self.finished_req_ids: set[str] = set()
        # Set by the engine (a StructuredOutputManager) once a constrained request arrives.
        self.structured_output_manager = None
        self._grammar_failed: list[Request] = []   # reported by the next update_from_output
        self._grammar_pending: list[Request] = []  # waiting for their grammar this step
        # Speculative decoding: a running request's drafts are scheduled after its last token.
        self.spec_stats = SpecDecodingStats(num_spec_tokens) if num_spec_tokens else None
        self.num_lookahead_tokens = num_lookahead_tokens   # slots a draft model writes ahead

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already scheduled.")
        self.requests[request.request_id] = request
        if self.by_priority:
            self.waiting.insert(bisect.bisect_right(self.waiting, _order(request), key=_order),
                                request)
        else:
            self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        """Plans one step and advances `num_computed_tokens` of every scheduled request."""
        num_scheduled_tokens: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        spec_tokens: dict[str, list[int]] = {}
        running_reqs, preempted = self._schedule_running(num_scheduled_tokens, new_block_ids,
                                                         spec_tokens)
        new_reqs: list[Request] = []
        # NOTE: a step that had to preempt admits no one, or the victim could come straight
        # back and thrash.
        if not preempted:
            new_reqs = self._schedule_waiting(num_scheduled_tokens)
        if not num_scheduled_tokens and self._grammar_pending:
            # Nothing to run but grammars compiling: pause a moment instead of spinning.
            self._grammar_pending[0].structured_output_request.wait(0.005)
        output = SchedulerOutput(
            scheduled_new_reqs=[self._new_request_data(r) for r in new_reqs],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in running_reqs],
                new_block_ids=[new_block_ids[r.request_id] for r in running_reqs],
                num_computed_tokens=[r.num_computed_tokens for r in running_reqs]),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            scheduled_spec_decode_tokens=spec_tokens)
        assert output.total_num_scheduled_tokens <= self.max_num_batched_tokens
        # The runner reads the pre-step counters above; the scheduler moves on right away.
        for req_id, num_tokens in num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        if self.structured_output_manager is not None:
            # Constrained requests whose chunk reaches their last token sample this step.
            sampling = [self.requests[i] for i in num_scheduled_tokens
                        if self.requests[i].num_computed_tokens >= self.requests[i].num_tokens]
            output.grammar_output = self.structured_output_manager.grammar_bitmask(
                sampling, spec_tokens)
        self.finished_req_ids = set()
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[Request]:
        """Appends sampled tokens and applies the token-level stop checks.

        Returns the requests that got a new token or finished, for the engine to detokenize.
        """
        updated: list[Request] = []
        stopped: set[str] = set()
        for req_id, token_ids in zip(model_runner_output.req_ids,
                                     model_runner_output.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished or not token_ids:
                continue   # aborted meanwhile, or a partial prefill
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                # The KV of rejected drafts is stale: the next step rewrites those slots.
                num_accepted = len(token_ids) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_stats.observe_draft(len(drafts), num_accepted)
            for token_id in token_ids:
                request.append_output_token_ids(token_id)
                if check_stop(request, self.max_model_len) or self._advance_grammar(request, token_id):
                    stopped.add(req_id)
                    break
            updated.append(request)
        updated.extend(self._grammar_failed)
        self._grammar_failed = []
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
            for req_id in stopped:
                self._free_request(self.requests[req_id])
        if model_runner_output.spec_token_ids is not None:
            for req_id, drafts in zip(model_runner_output.req_ids,
                                      model_runner_output.spec_token_ids):
                request = self.requests.get(req_id)
                if request is not None and drafts and not request.is_finished:
                    request.spec_token_ids = self._fit_drafts(request, drafts)
        return updated

    def _fit_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The drafts worth verifying: within max_model_len, one short of max_tokens (the step
        adds the target's own token), and the prefix the request's grammar accepts."""
        room = self.max_model_len - request.num_tokens
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        drafts = drafts[:max(room, 0)]
        so_request = request.structured_output_request
        if so_request is not None and drafts:
            if not so_request.reasoning_ended:
                return []      # where the grammar would start inside the drafts is unknown
            drafts = drafts[:so_request.grammar.validate_tokens(drafts)]
        return drafts

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finishes requests from outside (abort, stop strings) and frees their blocks."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        to_finish = [self.requests[i] for i in set(request_ids) if i in self.requests]
        to_finish = [r for r in to_finish if not r.is_finished]
        if not to_finish:
            return
        ids = {r.request_id for r in to_finish}
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        for request in to_finish:
            request.status = finished_status
            self._free_request(request)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def _schedule_running(self, num_scheduled_tokens: dict[str, int],
                          new_block_ids: dict[str, list[int]], spec_tokens: dict[str, list[int]]
                          ) -> tuple[list[Request], list[Request]]:
        """Serves running requests in order (with their drafts, as far as the budget goes);
        returns (scheduled, preempted)."""
        scheduled: list[Request] = []
        preempted: list[Request] = []
        budget = self.max_num_batched_tokens
        req_index = 0
        while req_index < len(self.running) and budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if num_new_tokens == 0:
                # Its last token is not sampled yet (schedule() called twice without an update).
                req_index += 1
                continue
            while True:
                block_ids = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self._lookahead(
                        request.num_computed_tokens + num_new_tokens))
                if block_ids is not None:
                    break
                # NOTE: the victim is always at or after req_index, so it was not scheduled yet.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if block_ids is None:
                break
            scheduled.append(request)
            num_drafts = request.num_computed_tokens + num_new_tokens - request.num_tokens
            if num_drafts > 0:
                spec_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
            request.spec_token_ids = []
            new_block_ids[request.request_id] = block_ids
            num_scheduled_tokens[request.request_id] = num_new_tokens
            budget -= num_new_tokens
            req_index += 1
        return scheduled, preempted

    def _schedule_waiting(self, num_scheduled_tokens: dict[str, int]) -> list[Request]:
        """Admits waiting requests (new or preempted) with the budget left, prefix hits applied."""
        scheduled: list[Request] = []
        budget = self.max_num_batched_tokens - sum(num_scheduled_tokens.values())
        skipped: list[Request] = []   # grammars still compiling: they keep their place
        lora_skipped: list[Request] = []   # their adapter would need a slot no one frees yet
        loras = {r.lora_int_id for r in self.running} - {0}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._waits_for_grammar(request):
                skipped.append(self.waiting.popleft())
                continue
            lora_id = request.lora_int_id
            if lora_id and lora_id not in loras and len(loras) >= (self.max_loras or 0):
                lora_skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = self._num_new_tokens(request, num_computed, budget)
            if self.whole_prefills and num_computed + num_new_tokens < request.num_tokens:
                break           # the rest of the budget is too small for the whole prefill
            if self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, computed_blocks,
                    self._lookahead(num_computed + num_new_tokens)) is None:
                break
            self.waiting.popleft()
            if self.by_priority:   # the running list stays in serving (and preemption) order
                self.running.insert(bisect.bisect_right(self.running, _order(request),
                                                        key=_order), request)
            else:
                self.running.append(request)
            scheduled.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            num_scheduled_tokens[request.request_id] = num_new_tokens
            budget -= num_new_tokens
            if lora_id:
                loras.add(lora_id)
        self._grammar_pending = [r for r in skipped if not r.is_finished]
        self.waiting.extendleft(reversed(lora_skipped))
        for request in reversed(skipped):
            if request.is_finished:   # its grammar failed to compile
                self._free_request(request)
                self._grammar_failed.append(request)
            else:
                self.waiting.appendleft(request)
        return scheduled

    def _waits_for_grammar(self, request: Request) -> bool:
        """True while its grammar compiles, or when it failed (the request is then aborted)."""
        so_request = request.structured_output_request
        if so_request is None:
            return False
        if not so_request.is_ready():
            return True
        try:
            so_request.grammar
        except Exception as exc:   # noqa: BLE001 - any compile failure ends only this request
            logger.warning("Request %s: its grammar failed to compile: %s", request.request_id, exc)
            request.status = RequestStatus.FINISHED_ABORTED
            return True
        return False

    def _advance_grammar(self, request: Request, token_id: int) -> bool:
        """Feeds the token to the request's grammar; True when that ends the request."""
        so_request = request.structured_output_request
        if so_request is None:
            return False
        if not so_request.reasoning_ended:   # still reasoning: the grammar has not begun
            so_request.reasoning_ended = token_id == so_request.reasoning_end_token_id
            return False
        grammar = so_request.grammar
        if not grammar.accept_tokens(request.request_id, [token_id]):
            request.status = RequestStatus.FINISHED_ABORTED
            return True
        if grammar.is_terminated():   # the constraint is complete: only EOS could follow
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _lookahead(self, num_tokens_after_step: int) -> int:
        """Slots a draft model may write past the step, never past max_model_len (so one
        request always fits the cache)."""
        return max(min(self.num_lookahead_tokens, self.max_model_len - num_tokens_after_step), 0)

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, budget: int) -> int:
        num_new_tokens = request.num_tokens + len(request.spec_token_ids) - num_computed_tokens
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        return max(min(num_new_tokens, budget), 0)

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV and requeue at the front of the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if self.by_priority:
            self.waiting.insert(bisect.bisect_left(self.waiting, _order(request), key=_order),
                                request)
        else:
            self.waiting.appendleft(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request, prompt_embeds=request.prompt_embeds)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]


def _order(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
