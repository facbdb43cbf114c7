"""A TP x PP worker process: joins the groups, loads its shard, runs the step loop.

Every rank is its own Python process (`python -m minivllm.worker.worker_proc --worker-fd N`),
started by a launcher (`launcher.py`): the engine's `MultiprocExecutor` on node 0, `run_headless`
on the other nodes. The launcher and each of its workers share a socket pipe; the first message on it is a
`WorkerInit` (the pickled VllmConfig and the rank), later ones are:

    launcher -> rank 0        ("step", SchedulerOutput, sampled) | ("shutdown",)
                              | ("rpc", cloudpickle of (method, args, kwargs))
    worker -> launcher        ("ready", rank, num_blocks) | ("output", ModelRunnerOutput)
                              | ("rpc_result", [(kind, cloudpickle of value or error)] per rank)
                              | ("error", rank, traceback)

Rank 0 broadcasts each message to all ranks over a gloo "control" group, so workers on other
nodes get every step without a pipe to the engine. The last PP stage's TP rank 0 answers; when
it lives on another node it sends the output to rank 0 over the control group and rank 0 relays
it. `sampled` carries the previous step's sampled tokens to PP stages that do not sample.

A worker exits when its launcher dies (it polls its parent pid), when rank 0's pipe closes, or
when a peer dies (gloo raises on the closed connection); it reports an exception before exiting.
"""

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from minivllm.config import VllmConfig

# A hung collective (not a dead peer: that fails at once) raises after this long.
DIST_TIMEOUT_S = float(os.environ.get("MINIVLLM_DIST_TIMEOUT_S", "600"))
# Ranks idle in the control broadcast between requests; a server may idle for days.
_CONTROL_TIMEOUT = timedelta(days=30)
_PARENT_POLL_S = 0.5


@dataclass
class WorkerInit:
    vllm_config: VllmConfig
    rank: int
    distributed_init_method: str      # tcp://host:port
    launcher_pid: int                 # the worker exits when this process is gone
    num_threads: int                  # torch CPU threads, the node's cores split across its ranks
    is_engine_node: bool              # True when the launcher is the engine (node 0)


def _exit_when_parent_dies(parent_pid: int) -> None:
    """Never outlive the launcher, even while the main thread is blocked in a collective."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _run_worker(init: WorkerInit, conn: Connection) -> None:
    """Join the groups, load this rank's shard, agree on the block count, then serve steps."""
    import torch
    import torch.distributed as dist

    from minivllm.distributed import GroupCoordinator
    from minivllm.plugins import load_general_plugins
    from minivllm.worker.worker import get_worker_cls

    load_general_plugins()     # models registered by plugins resolve in this rank too
    pc = init.vllm_config.parallel_config
    torch.set_num_threads(init.num_threads)
    worker = get_worker_cls(pc)(init.vllm_config, init.rank, init.distributed_init_method)
    worker.init_device(timeout_s=DIST_TIMEOUT_S)
    ranks = list(range(pc.world_size))
    # One rank (distributed_executor_backend="mp" at TP = PP = 1) has no group to join.
    group = (dist.new_group(ranks, backend="gloo", timeout=_CONTROL_TIMEOUT)
             if pc.world_size > 1 else None)
    control = GroupCoordinator(ranks, init.rank, group, "control")
    if pc.nnodes > 1:
        _check_same_settings(init, control)
    worker.load_model()
    # Every rank must index the same blocks: all use the smallest count any rank can afford.
    num_blocks = torch.tensor([worker.determine_num_blocks()], dtype=torch.int64)
    if pc.world_size > 1:
        dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN, group=control.cpu_group)
    worker.initialize_cache(int(num_blocks))
    conn.send(("ready", init.rank, int(num_blocks)))
    _step_loop(worker, control, conn, init)


def _settings(vllm_config: VllmConfig) -> dict[str, Any]:
    """What every node must agree on (each node builds its config from its own flags)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    return {"tensor_parallel_size": pc.tensor_parallel_size,
            "pipeline_parallel_size": pc.pipeline_parallel_size, "architectures": mc.architectures,
            "num_layers": mc.get_num_layers(), "dtype": str(mc.dtype),
            "max_model_len": mc.max_model_len, "seed": mc.seed, "block_size": cc.block_size,
            "kv_cache_dtype": cc.cache_dtype, "quantization": type(vllm_config.quant_config).__name__,
            "VLLM_PP_LAYER_PARTITION": os.environ.get("VLLM_PP_LAYER_PARTITION")}


def _check_same_settings(init: WorkerInit, control: Any) -> None:
    """Every rank learns every rank's differences from rank 0, so all raise the same error."""
    import torch.distributed as dist

    ref = control.broadcast_object(_settings(init.vllm_config) if init.rank == 0 else None, src=0)
    mine = _settings(init.vllm_config)
    diff = {k: v for k, v in mine.items() if ref[k] != v}
    node_rank = init.vllm_config.parallel_config.node_rank
    all_diffs: list[Any] = [None] * control.world_size
    dist.all_gather_object(all_diffs, (node_rank, diff), group=control.cpu_group)
    bad = {node: d for node, d in all_diffs if d}
    if bad:
        node, d = next(iter(bad.items()))
        raise ValueError(f"node {node} was started with other engine settings than node 0: "
                         + ", ".join(f"{k}={v!r} (node 0: {ref[k]!r})" for k, v in d.items())
                         + ". Start every node with the same model and engine flags.")


def _step_loop(worker: Any, control: Any, conn: Connection, init: WorkerInit) -> None:
    pc = init.vllm_config.parallel_config
    output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
    relay = output_rank not in range(pc.world_size // pc.nnodes)   # output rank is off node 0
    while True:
        msg = conn.recv() if init.rank == 0 else None
        msg = control.broadcast_object(msg, src=0)
        if msg[0] == "shutdown":
            return
        if msg[0] == "rpc":
            _run_rpc(worker, control, conn, init.rank, msg[1])
            continue
        _, scheduler_output, sampled = msg
        if sampled:
            worker.apply_sampled_tokens(sampled)
        output = worker.execute_model(scheduler_output)
        if init.rank == output_rank:
            if relay:
                control.send_object(output, dst=0)
            else:
                conn.send(("output", output))
        elif init.rank == 0 and relay:
            conn.send(("output", control.recv_object(src=output_rank)))


def _run_rpc(worker: Any, control: Any, conn: Connection, rank: int, call: bytes) -> None:
    """A collective_rpc (adapters, `LLM.apply_model`, ...) on every rank; rank 0 answers with
    each rank's result or error. A failing call is the caller's mistake, not a worker failure:
    every rank keeps serving, and the engine re-raises the error."""
    import cloudpickle
    import torch.distributed as dist

    from minivllm.v1.serial_utils import run_method

    try:
        method, args, kwargs = cloudpickle.loads(call)
        result = ("ok", cloudpickle.dumps(run_method(worker, method, args, kwargs)))
    except Exception as exc:   # noqa: BLE001 - sent back to the caller
        try:
            result = ("error", cloudpickle.dumps(exc))
        except Exception:      # noqa: BLE001 - an exception that does not pickle
            result = ("error", cloudpickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}")))
    results: list[Any] = [result]
    if control.world_size > 1:
        results = [None] * control.world_size
        dist.all_gather_object(results, result, group=control.cpu_group)
    if rank == 0:
        conn.send(("rpc_result", results))


def worker_main(fd: int) -> int:
    """Entry of a worker process; `fd` is its end of the launcher's pipe."""
    # Ctrl-C reaches the whole process group: the launcher handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    init: WorkerInit = conn.recv()
    _exit_when_parent_dies(init.launcher_pid)
    code = 0
    try:
        _run_worker(init, conn)
    except EOFError:
        code = 1                          # the launcher closed the pipe: it is gone
    except BaseException:
        code = 1
        tb = traceback.format_exc()
        if not init.is_engine_node:       # the engine re-raises it; a headless node prints it
            sys.stderr.write(f"[minivllm worker rank {init.rank}] {tb}")
        try:
            conn.send(("error", init.rank, tb))
        except (OSError, ValueError):
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)                        # skip interpreter teardown: gloo may block in it


def main(argv: list[str] | None = None) -> int:
    """`python -m minivllm.worker.worker_proc --worker-fd N`, as the launcher starts a worker.

    Headless nodes are started with the engine flags, above this package:
    `minivllm serve --nnodes N --node-rank R ...` (or torchrun's environment).
    """
    parser = argparse.ArgumentParser(
        prog="python -m minivllm.worker.worker_proc",
        description="Run one worker process (started by a launcher). To run a node's workers, "
                    "use `minivllm serve --nnodes N --node-rank R ...`.")
    parser.add_argument("--worker-fd", type=int, required=True,
                        help="this worker's end of the launcher's pipe")
    args = parser.parse_args(argv)
    return worker_main(args.worker_fd)


if __name__ == "__main__":
    from minivllm.worker import worker_proc as _module   # one copy of the module, not __main__

    sys.exit(_module.main())
