"""The synchronous engine loop: add requests, then step: schedule -> execute -> update -> detokenize.

`LLMEngine.from_engine_args(engine_args)` is the one way the offline LLM, the server, the CLI
and the benchmarks build an engine: it validates the VllmConfig, loads the tokenizer and creates
the executor, which the engine then owns (`shutdown()` ends it).

`LLMEngine(vllm_config, executor, tokenizer)` reads only `vllm_config.scheduler_config.
{max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold, policy (optional)}`,
`vllm_config.cache_config.{block_size, enable_prefix_caching}` and
`vllm_config.model_config.max_model_len` (any object with these attributes works, e.g. a
SimpleNamespace in tests). The executor provides `num_blocks` and
`execute_model(scheduler_output) -> ModelRunnerOutput`; it is called once per step, also for a
step that schedules no tokens, so the runner always learns about finished and preempted requests.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from tqdm import tqdm

from minivllm import envs
from minivllm.engine import pooling
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.input_processor import InputProcessor
from minivllm.engine.lora_mixin import LoRAMixin
from minivllm.engine.sleep_mixin import SleepMixin
from minivllm.engine.output_processor import (ChildState, ParentState, process_child,
                                              to_logprob_dict)
from minivllm.engine.request import Request, RequestStatus
from minivllm.engine.sched_utils import has_prefix_lm_layers
from minivllm.engine.scheduler import Scheduler
from minivllm.inputs import PromptType
from minivllm.lora.request import LoRARequest
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.reasoning import reasoning_parser_for
from minivllm.sampling_params import MAX_LOGPROBS, SamplingParams
from minivllm.transformers_utils.tokenizer import get_tokenizer
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.metrics.reader import Metric, scheduler_metrics
from minivllm.v1.outputs import LogprobEntry, ModelRunnerOutput
from minivllm.v1.sample.logits_processor import (check_logitsprocs_supported,
                                                 load_custom_logitsprocs)


class Executor(Protocol):
    num_blocks: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class LLMEngine(LoRAMixin, SleepMixin):
    """Drives the scheduler and an executor; turns sampled tokens into `RequestOutput`s."""

    def __init__(self, vllm_config: Any, executor: Executor, tokenizer: Any | None,
                 eos_token_id: int | None = None) -> None:
        sched, cache, model = (vllm_config.scheduler_config, vllm_config.cache_config,
                               vllm_config.model_config)
        self.vllm_config = vllm_config
        self.lora_config = getattr(vllm_config, "lora_config", None)
        # lora_int_id -> the adapter registered with add_lora (or by a request's first use)
        self._lora_requests: dict[int, LoRARequest] = {}
        self.max_model_len: int = model.max_model_len
        self.vocab_size: int | None = model.get_vocab_size() if hasattr(model, "get_vocab_size") \
            else None
        limit = getattr(model, "max_logprobs", MAX_LOGPROBS)
        self.max_logprobs: int = self.vocab_size if limit == -1 and self.vocab_size else limit
        # generation_config.json's fields: its eos ids stop every request too (vLLM's)
        self.generation_config_fields = getattr(model, "try_get_generation_config", dict)()
        self.scheduler = Scheduler(
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            block_size=cache.block_size,
            num_blocks=executor.num_blocks,
            max_model_len=self.max_model_len,
            enable_prefix_caching=cache.enable_prefix_caching,
            long_prefill_token_threshold=getattr(sched, "long_prefill_token_threshold", 0),
            whole_prefills=has_prefix_lm_layers(vllm_config),
            policy=getattr(sched, "policy", "fcfs"),
            num_spec_tokens=_num_spec_tokens(vllm_config),
            num_lookahead_tokens=_num_lookahead_tokens(vllm_config),
            max_loras=self.lora_config.max_loras if self.lora_config is not None else None)
        self.executor = executor
        self.tokenizer = tokenizer
        if eos_token_id is None and tokenizer is not None:
            eos_token_id = tokenizer.eos_token_id
        self.eos_token_id = eos_token_id
        self.reasoning_parser = reasoning_parser_for(vllm_config, tokenizer)
        self.input_processor = InputProcessor(vllm_config, tokenizer, self.vocab_size)
        # custom logits processors' classes: their validate_params checks each request
        self.logitsprocs_classes = load_custom_logitsprocs(getattr(model, "logits_processors",
                                                                   None))
        self._parents: dict[str, ParentState] = {}
        self._children: dict[str, ChildState] = {}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """Validate and assemble the VllmConfig, load the tokenizer, start the executor."""
        # NOTE: imported here so the fake-executor tests load this module without the model stack.
        from minivllm.engine.executor import create_executor

        vllm_config = engine_args.create_engine_config()
        check_logitsprocs_supported(vllm_config)   # before any worker builds them
        model_config = vllm_config.model_config
        tokenizer = None if model_config.skip_tokenizer_init else get_tokenizer(
            model_config.tokenizer, model_config.trust_remote_code, model_config.tokenizer_mode)
        executor = create_executor(vllm_config)
        try:
            return cls(vllm_config, executor, tokenizer)
        except BaseException:
            executor.shutdown()   # e.g. a KV cache too small for max_model_len: no stray workers
            raise

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0) -> None:
        """Queues a prompt (text or token ids); n > 1 becomes n child requests.

        `lora_request` picks an adapter (None: the base model); one not seen before is loaded
        first (`add_lora`), so a bad adapter is a ValueError here, before anything is queued.
        `priority` (lower first) needs the priority scheduling policy.
        """
        if request_id in self._parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        self.check_awake()
        if priority and not self.scheduler.by_priority:
            raise ValueError(f"priority {priority} needs priority scheduling; start the engine "
                             "with --scheduling-policy priority.")
        if lora_request is not None and lora_request.lora_int_id not in self._lora_requests:
            self.add_lora(lora_request)
        params = params if params is not None else SamplingParams()
        pooling_params = pooling.check_params(params, self.vllm_config.model_config)
        params = pooling.prompt_only_params() if pooling_params is not None else params
        processed = self.input_processor.process(prompt, pooling_params or params)
        if processed.embeds is not None and pooling_params is not None:
            raise ValueError("prompt_embeds work with generating models only.")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead.")
        if self.vocab_size is not None:
            params.verify_vocab(self.vocab_size)
        params.verify_logprobs(self.max_logprobs)
        for logitsproc_cls in self.logitsprocs_classes:
            logitsproc_cls.validate_params(params)
        if params.structured_outputs is not None:
            # Validates the constraint (ValueError) before any child is queued.
            self._structured_output_manager().grammar_init(params.structured_outputs)
        parent = ParentState(request_id, processed.text, processed.token_ids,
                             pooling_params=pooling_params, cache_salt=processed.cache_salt,
                             prompt_embeds=processed.embeds)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]   # nothing predicts the first prompt token
        for index in range(params.n):
            self._add_child(parent, index, params, arrival_time, lora_request, priority)
        self._parents[request_id] = parent

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the requests that progressed or finished."""
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._record_prompt_logprobs(runner_output)
        pooling.record_pooled(self._children, runner_output)
        row_of = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        touched: dict[str, ParentState] = {}
        for request in updated:
            child = self._children.get(request.request_id)
            if child is None:
                continue
            row_logprobs = None
            if runner_output.logprobs is not None and request.request_id in row_of:
                row_logprobs = runner_output.logprobs[row_of[request.request_id]]
            self._process_child(child, row_logprobs)
            touched[child.parent.request_id] = child.parent
        return [self._make_output(parent) for parent in touched.values()]

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Aborts requests (by the id given to add_request); unknown ids are ignored."""
        self.abort_with_outputs(request_id, outputs=False)

    def abort_with_outputs(self, request_id: str | Iterable[str],
                           outputs: bool = True) -> list[RequestOutput]:
        """Aborts requests and returns each generating one's final output (finish_reason
        "abort", what it generated so far): for callers whose clients still wait
        (pause_generation). Pooling requests have no partial result: none is returned."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        parents = [self._parents[r] for r in request_ids
                   if r in self._parents and self._parents[r].pooling_params is None]
        child_ids = []
        for parent_id in request_ids:
            parent = self._parents.pop(parent_id, None)
            if parent is None:
                continue
            for child in parent.children:
                child_ids.append(child.request.request_id)
                del self._children[child.request.request_id]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        return [self._make_output(parent) for parent in parents] if outputs else []

    def run_until_finished(self, request_ids: list[str],
                           on_output: Callable[[RequestOutput], None] | None = None, *,
                           use_tqdm: bool = False) -> list[RequestOutput]:
        """Steps until no request is unfinished; the final outputs of `request_ids`, in order.

        `on_output` sees every output of every step (first-token clocks); `use_tqdm` shows a bar
        of finished requests. When a step raises, `request_ids` are aborted so the engine stays
        usable.
        """
        if use_tqdm:
            with tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True) as bar:
                def count(output: RequestOutput) -> None:
                    if output.finished:
                        bar.update(1)
                    if on_output is not None:
                        on_output(output)
                return self.run_until_finished(request_ids, count)
        finished: dict[str, RequestOutput] = {}
        try:
            while self.has_unfinished_requests():
                for output in self.step():
                    if output.finished:
                        finished[output.request_id] = output
                    if on_output is not None:
                        on_output(output)
        except BaseException:
            self.abort_request(request_ids)
            raise
        return [finished[i] for i in request_ids]

    def shutdown(self) -> None:
        """Stops the executor (its worker processes, if any); idempotent."""
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self.scheduler.structured_output_manager is not None:
            self.scheduler.structured_output_manager.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached KV block; False, with nothing done, while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def start_profile(self) -> None:
        """vLLM's: every rank runs the torch profiler until `stop_profile` (traces in
        VLLM_TORCH_PROFILER_DIR, one per rank); ValueError when it is not set."""
        trace_dir = envs.VLLM_TORCH_PROFILER_DIR
        if not trace_dir:
            raise ValueError("Set VLLM_TORCH_PROFILER_DIR to the folder the profiler traces go to.")
        self.collective_rpc("start_profile", args=(os.path.abspath(trace_dir),
                                                   envs.VLLM_TORCH_PROFILER_RECORD_SHAPES,
                                                   envs.VLLM_TORCH_PROFILER_WITH_STACK))

    def stop_profile(self) -> None:
        self.collective_rpc("stop_profile")

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: a Worker method (by name) or `method(worker, ...)` on every rank; the
        results in rank order."""
        return self.executor.collective_rpc(method, timeout, args, kwargs)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def get_metrics(self) -> list[Metric]:
        """vLLM's offline snapshot (`LLM.get_metrics`): v1/metrics/reader.py."""
        return scheduler_metrics(self.scheduler,
                                 str(getattr(self.vllm_config.model_config, "model", "")))

    def tokenize_prompt(self, prompt: PromptType) -> list[int]:
        """The token ids a request for `prompt` starts from (text tokenised as add_request
        does)."""
        return self.input_processor.tokenize(prompt)[1]

    def _add_child(self, parent: ParentState, index: int, params: SamplingParams,
                   arrival_time: float | None, lora_request: LoRARequest | None = None,
                   priority: int = 0) -> None:
        n = params.n
        # The engine's own copy, so eos can be added to the stop ids min_tokens masks. Children
        # get distinct seeds (else they would be identical) and only child 0 asks for prompt
        # logprobs (the prompt is shared).
        child_params = dataclasses.replace(
            params, n=1,
            seed=params.seed + index if params.seed is not None else None,
            prompt_logprobs=params.prompt_logprobs if index == 0 else None)
        child_params.update_from_generation_config(self.generation_config_fields, self.eos_token_id)
        child_params.update_from_tokenizer(self.tokenizer)   # bad_words -> token ids
        child_id = parent.request_id if n == 1 else f"{index}_{parent.request_id}"
        request = Request(child_id, parent.prompt_token_ids, child_params,
                          eos_token_id=self.eos_token_id, arrival_time=arrival_time,
                          lora_request=lora_request, priority=priority,
                          cache_salt=parent.cache_salt, prompt_embeds=parent.prompt_embeds)
        if params.structured_outputs is not None:
            # Compiles off this thread; the scheduler admits the request once it is ready.
            so_request = self._structured_output_manager().grammar_init(params.structured_outputs)
            if self.reasoning_parser is not None:   # the grammar starts after the reasoning
                so_request.reasoning_end_token_id = self.reasoning_parser.reasoning_end_token_id
                so_request.reasoning_ended = self.reasoning_parser.is_reasoning_end(
                    parent.known_prompt_token_ids)
            request.structured_output_request = so_request
        detokenizer = None
        if self.tokenizer is not None and params.detokenize:
            detokenizer = IncrementalDetokenizer(self.tokenizer, parent.known_prompt_token_ids,
                                                 child_params)
        child = ChildState(request, parent, index, detokenizer)
        if params.logprobs is not None:
            child.logprobs, child.cumulative_logprob = [], 0.0
        self.scheduler.add_request(request)
        parent.children.append(child)
        self._children[child_id] = child

    def _process_child(self, child: ChildState,
                       token_logprobs: list[list[LogprobEntry]] | None) -> None:
        request = child.request
        stop_string = process_child(child, token_logprobs, self.tokenizer)
        if stop_string is not None and request.stop_reason != stop_string:
            # A stop string overrides a length cap reached by the same token.
            request.stop_reason = stop_string
            if request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _structured_output_manager(self) -> Any:
        """Built on the first constrained request (imports llguidance, converts the tokenizer
        lazily in its pool)."""
        if self.scheduler.structured_output_manager is None:
            # NOTE: imported here so that engines that never constrain skip llguidance.
            from minivllm.v1.structured_output import StructuredOutputManager

            vocab_size = self.vocab_size or (len(self.tokenizer) if self.tokenizer else 0)
            self.scheduler.structured_output_manager = StructuredOutputManager(
                self.tokenizer, vocab_size)
        return self.scheduler.structured_output_manager

    def _record_prompt_logprobs(self, runner_output: ModelRunnerOutput) -> None:
        for req_id, positions in runner_output.prompt_logprobs.items():
            child = self._children.get(req_id)
            if child is None or child.parent.prompt_logprobs is None:
                continue
            child.parent.prompt_logprobs.extend(to_logprob_dict(p, self.tokenizer)
                                               for p in positions)

    def _make_output(self, parent: ParentState) -> RequestOutput:
        outputs = []
        for child in parent.children:
            request = child.request
            finished = request.is_finished
            text = child.detokenizer.get_output_text(finished) if child.detokenizer else ""
            outputs.append(CompletionOutput(
                index=child.index, text=text, token_ids=list(request.output_token_ids),
                cumulative_logprob=child.cumulative_logprob,
                logprobs=list(child.logprobs) if child.logprobs is not None else None,
                finish_reason=request.get_finished_reason(), stop_reason=request.stop_reason))
        finished = all(o.finish_reason is not None for o in outputs)
        if finished:
            self._parents.pop(parent.request_id, None)
            for child in parent.children:
                self._children.pop(child.request.request_id, None)
        if parent.pooling_params is not None:   # prompt-only: one final output, pooled
            return pooling.make_pooling_output(parent, self.vllm_config.model_config)
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=None if parent.prompt_embeds is not None else parent.prompt_token_ids,
            prompt_logprobs=list(parent.prompt_logprobs) if parent.prompt_logprobs else None,
            outputs=outputs, finished=finished,
            num_cached_tokens=max(parent.children[0].request.num_cached_tokens, 0))



def _num_spec_tokens(vllm_config: Any) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec.num_speculative_tokens if spec is not None else 0


def _num_lookahead_tokens(vllm_config: Any) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec.num_lookahead_slots if spec is not None else 0
