"""MultiprocExecutor: the engine's side of TP x PP worker processes (design in worker/worker_proc.py).

The engine process holds no model. It starts this node's ranks, sends each step to rank 0 (which
broadcasts it to every rank, on every node) and waits for the last PP stage's answer. While it
waits it watches every local worker: a process that dies or reports an exception ends the wait
with a RuntimeError at once, and a step that takes longer than VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
(300) also fails, so the engine never hangs. Workers are stopped on `shutdown()`, when the
executor is garbage-collected and at interpreter exit (a weakref finalizer).
"""

import os
import pickle
import signal
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import cloudpickle

from minivllm.config import VllmConfig
from minivllm.distributed.utils import get_pp_indices
from minivllm.logger import init_logger
from minivllm.lora.request import LoRARequest
from minivllm.model_executor.models.registry import ModelRegistry
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.v1.serial_utils import check_method
from minivllm.worker.launcher import (WorkerProcHandle, distributed_init_method,
                                         launch_worker_procs, local_ranks, stop_worker_procs)

logger = init_logger(__name__)

EXECUTE_MODEL_TIMEOUT_S = float(os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300"))
READY_TIMEOUT_S = float(os.environ.get("VLLM_ENGINE_READY_TIMEOUT_S", "600"))
_POLL_S = 0.1            # how often liveness is checked while waiting
_ERROR_GRACE_S = 1.0     # after a failure, collect the other ranks' reports this long


class MultiprocExecutor:
    """TP x PP ranks in worker processes; node 0's share is started here."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        pc = vllm_config.parallel_config
        if pc.node_rank != 0:
            raise ValueError(f"node_rank={pc.node_rank} runs only workers: start that node with "
                             "`minivllm ... --node-rank R` (run_headless), not with an engine")
        _check_pipeline_split(vllm_config)
        self.vllm_config = vllm_config
        self.pp_size = pc.pipeline_parallel_size
        self._failure: str | None = None
        # Tokens sampled by the last stage in the previous step, for the stages before it.
        self._sampled: dict[str, list[int]] = {}
        self._outstanding = 0    # steps sent whose answer was not read yet
        init_method = distributed_init_method(vllm_config)
        logger.info("starting %d worker processes (TP=%d, PP=%d, nnodes=%d) at %s",
                    pc.world_size, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                    pc.nnodes, init_method)
        self.workers: list[WorkerProcHandle] = launch_worker_procs(
            vllm_config, local_ranks(vllm_config), init_method)
        self._finalizer = weakref.finalize(self, stop_worker_procs, self.workers)
        ready = self._wait_for(len(self.workers), READY_TIMEOUT_S, "load the model")
        # Workers agreed on the minimum over all ranks (an all-reduce), so every count is equal.
        self.num_blocks: int = min(msg[2] for msg in ready)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if self._outstanding:
            # The previous wait was interrupted (e.g. Ctrl-C): that step's answer is stale.
            for msg in self._wait_for(self._outstanding, EXECUTE_MODEL_TIMEOUT_S, "finish a step"):
                self._remember_sampled(msg[1])
            self._outstanding = 0
        sampled = self._sampled if self.pp_size > 1 else None
        self._send_to_rank0(("step", scheduler_output, sampled))
        self._outstanding = 1
        (msg,) = self._wait_for(1, EXECUTE_MODEL_TIMEOUT_S, "finish a step")
        self._outstanding = 0
        output: ModelRunnerOutput = msg[1]
        self._remember_sampled(output)
        return output

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._lora_call("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_call("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        return self._lora_call("list_loras")

    def _lora_call(self, method: str, *args: Any) -> Any:
        """Rank 0's answer; an adapter that cannot be read is a ValueError, as one that does
        not fit the model."""
        try:
            return self.collective_rpc(method, args=args)[0]
        except OSError as exc:
            raise ValueError(str(exc)) from exc

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """`method` (a Worker method's name, or a function taking the worker first; lambdas
        too, sent with cloudpickle) on every rank; the results in rank order. The first rank's
        error is re-raised here, and the workers go on serving."""
        check_method(method)
        if self._failure is not None:
            raise RuntimeError(self._failure)
        call = cloudpickle.dumps((method, tuple(args), dict(kwargs or {})))
        self._send_to_rank0(("rpc", call))
        name = method if isinstance(method, str) else getattr(method, "__name__", "a function")
        (msg,) = self._wait_for(1, timeout or EXECUTE_MODEL_TIMEOUT_S, f"run {name}")
        results = msg[1]
        for kind, payload in results:
            if kind == "error":
                raise cloudpickle.loads(payload)
        return [cloudpickle.loads(payload) for _, payload in results]

    def _send_to_rank0(self, message: tuple) -> None:
        # NOTE: plain pickle, not the pipe's own (multiprocessing's) pickler, which would send
        # a tensor (a prompt's embeddings) as shared memory that only a multiprocessing child
        # may open; rank 0's `recv()` reads either.
        try:
            self.workers[0].conn.send_bytes(pickle.dumps(message))
        except (OSError, ValueError):
            pass                 # rank 0 is gone; _wait_for reports how

    def _remember_sampled(self, output: ModelRunnerOutput) -> None:
        if self.pp_size > 1:
            self._sampled = {req_id: tokens for req_id, tokens
                             in zip(output.req_ids, output.sampled_token_ids) if tokens}

    def check_health(self) -> None:
        """Raise if the executor failed before or a worker process has exited since."""
        if self._failure is None:
            dead = [h for h in self.workers if h.proc.poll() is not None]
            if dead:
                self._fail([])
        if self._failure is not None:
            raise RuntimeError(self._failure)

    def shutdown(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ waiting and failing

    def _wait_for(self, count: int, timeout_s: float, what: str) -> list[tuple]:
        """Collect `count` non-error messages from the workers, watching their liveness."""
        messages: list[tuple] = []
        deadline = time.monotonic() + timeout_s
        while len(messages) < count:
            received = self._poll_messages(_POLL_S)
            errors = [m for m in received if m[0] == "error"]
            messages += [m for m in received if m[0] != "error"]
            if errors or (len(messages) < count and any(h.proc.poll() is not None
                                                        for h in self.workers)):
                self._fail(errors)
            if time.monotonic() > deadline and len(messages) < count:
                self._fail([], f"the workers did not {what} within {timeout_s:.0f} s "
                           "(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS / VLLM_ENGINE_READY_TIMEOUT_S)")
        return messages

    def _poll_messages(self, timeout_s: float) -> list[tuple]:
        open_conns = [h.conn for h in self.workers if not h.closed]
        if not open_conns:
            time.sleep(timeout_s)
            return []
        messages = []
        for conn in wait(open_conns, timeout=timeout_s):
            handle = next(h for h in self.workers if h.conn is conn)
            try:
                messages.append(conn.recv())
            except (EOFError, OSError):
                handle.closed = True           # the process is exiting; poll() will tell how
        return messages

    def _fail(self, errors: list[tuple], reason: str | None = None) -> None:
        """Stop every worker, say why (deaths first: they cause the others' errors), and raise."""
        deadline = time.monotonic() + _ERROR_GRACE_S
        while time.monotonic() < deadline and any(not h.closed for h in self.workers):
            errors += [m for m in self._poll_messages(_POLL_S) if m[0] == "error"]
        reported = {rank for _, rank, _ in errors}
        dead = [h for h in self.workers if h.proc.poll() not in (None, 0) and h.rank not in reported]
        lines = ["minivllm worker processes failed" + (f": {reason}" if reason else ":")]
        if dead:
            lines.append(_describe_deaths(dead))
        for i, (_, rank, tb) in enumerate(errors):      # in order of arrival
            if i == 0 and not dead:
                lines.append(f"worker rank {rank} raised:\n{tb.rstrip()}")
            else:
                lines.append(f"worker rank {rank} then failed: {tb.strip().splitlines()[-1]}")
        lines.append("All workers were stopped; create a new LLM to continue.")
        self._failure = "\n".join(lines)
        self._finalizer.detach()
        stop_worker_procs(self.workers, graceful=False)   # some may hang in a collective
        raise RuntimeError(self._failure)


def _describe_deaths(handles: list[WorkerProcHandle]) -> str:
    parts = []
    for h in handles:
        code = h.proc.poll()
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = f"signal {signal.Signals(-code).name}"
        parts.append(f"worker rank {h.rank} (pid {h.proc.pid}) died with {how}")
    return "; ".join(parts)


def _check_pipeline_split(vllm_config: VllmConfig) -> None:
    """Fail before any process starts: a model class without `SupportsPP` under PP > 1
    (NotImplementedError), a bad VLLM_PP_LAYER_PARTITION (ValueError)."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        if not ModelRegistry.is_pp_supported_model(vllm_config.model_config.architectures):
            raise NotImplementedError(
                "Pipeline parallelism is not supported for this model. "
                "Supported models implement the `SupportsPP` interface.")
        get_pp_indices(vllm_config.model_config.get_num_layers(), 0, pp)

