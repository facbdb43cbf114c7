"""Starting and stopping worker processes; headless nodes (--node-rank >= 1) run only these.

The engine-args side (flags, torchrun's environment) stays above this package: the CLI turns
them into a VllmConfig and calls `run_headless(vllm_config)`.

`launch_worker_procs` starts one `python -m minivllm.worker.worker_proc` per local rank and sends
it a `WorkerInit`; `stop_worker_procs` ends them (politely, then SIGTERM, then SIGKILL). The
engine's MultiprocExecutor uses both on node 0; `run_headless` uses them on the other nodes and
waits until the job ends (every worker exits when rank 0 broadcasts the shutdown, or when a peer
or the engine dies).
"""

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any

import minivllm
from minivllm.config import VllmConfig
from minivllm.logger import init_logger
from minivllm.worker.worker_proc import WorkerInit

logger = init_logger(__name__)

DEFAULT_MASTER_PORT = 29501            # vLLM's default when several nodes meet
_POLL_S = 0.5


@dataclass
class WorkerProcHandle:
    """The launcher's view of one worker process."""

    rank: int
    proc: subprocess.Popen
    conn: Connection
    closed: bool = False              # the pipe hit EOF (the process is exiting)


def distributed_init_method(vllm_config: VllmConfig) -> str:
    """tcp://master_addr:master_port; a free local port on one node when none is given."""
    pc = vllm_config.parallel_config
    port = pc.master_port
    if port is None:
        port = _free_port() if pc.nnodes == 1 else DEFAULT_MASTER_PORT
    host = f"[{pc.master_addr}]" if ":" in pc.master_addr else pc.master_addr
    return f"tcp://{host}:{port}"


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def local_ranks(vllm_config: VllmConfig) -> range:
    """Global ranks on this node: ranks are dealt to nodes in contiguous runs."""
    pc = vllm_config.parallel_config
    per_node = pc.world_size // pc.nnodes
    return range(pc.node_rank * per_node, (pc.node_rank + 1) * per_node)


def launch_worker_procs(vllm_config: VllmConfig, ranks: range,
                        init_method: str) -> list[WorkerProcHandle]:
    """Start one process per rank in `ranks` and send each its WorkerInit."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cpus // len(ranks))
    env = dict(os.environ)
    # The child must import this very package, wherever the parent found it.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(minivllm.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    # Under torchrun this would make rank 0 join the agent's store instead of hosting ours.
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    handles: list[WorkerProcHandle] = []
    try:
        for rank in ranks:
            parent_conn, child_conn = Pipe(duplex=True)
            fd = child_conn.fileno()
            proc = subprocess.Popen(
                [sys.executable, "-m", "minivllm.worker.worker_proc", "--worker-fd", str(fd)],
                pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
            child_conn.close()
            handles.append(WorkerProcHandle(rank, proc, parent_conn))
            parent_conn.send(WorkerInit(vllm_config, rank, init_method, os.getpid(), threads,
                                        vllm_config.parallel_config.node_rank == 0))
    except BaseException:
        stop_worker_procs(handles, graceful=False)
        raise
    return handles


def stop_worker_procs(handles: list[WorkerProcHandle], graceful: bool = True,
                      grace_s: float = 5.0) -> None:
    """Ask rank 0 to end the job (it tells every rank), then terminate, then kill stragglers."""
    if graceful and handles and handles[0].rank == 0 and handles[0].proc.poll() is None:
        try:
            handles[0].conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
    for signal_fn, wait_s in ((None, grace_s if graceful else 0.0),
                              (subprocess.Popen.terminate, 2.0), (subprocess.Popen.kill, 5.0)):
        alive = [h.proc for h in handles if h.proc.poll() is None]
        if not alive:
            break
        if signal_fn is not None:
            for proc in alive:
                signal_fn(proc)
        deadline = time.monotonic() + wait_s
        for proc in alive:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for h in handles:
        h.conn.close()


# ---------------------------------------------------------------------------- headless nodes

def run_headless(vllm_config: VllmConfig) -> int:
    """Run this node's workers (node_rank >= 1, no engine) until the job ends; the exit code."""
    pc = vllm_config.parallel_config
    if pc.nnodes == 1 or pc.node_rank == 0:
        raise ValueError("headless mode runs the workers of --node-rank 1..nnodes-1 "
                         f"(got nnodes={pc.nnodes}, node_rank={pc.node_rank})")
    ranks = local_ranks(vllm_config)
    handles = launch_worker_procs(vllm_config, ranks, distributed_init_method(vllm_config))
    logger.info("node %d: started worker ranks %d..%d, waiting for the engine at %s",
                pc.node_rank, ranks[0], ranks[-1], distributed_init_method(vllm_config))

    def on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return _wait_headless(handles)
    finally:
        stop_worker_procs(handles, graceful=False, grace_s=0.0)


def _wait_headless(handles: list[WorkerProcHandle]) -> int:
    """Until every worker has exited: 0 when all ended cleanly, else 1 (the rest are stopped)."""
    while True:
        for conn in wait([h.conn for h in handles if not h.closed], timeout=_POLL_S):
            handle = next(h for h in handles if h.conn is conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                handle.closed = True
                continue
            if msg[0] == "ready":
                logger.info("worker rank %d is ready (%d KV blocks)", msg[1], msg[2])
        codes = [h.proc.poll() for h in handles]
        failed = [(h.rank, c) for h, c in zip(handles, codes) if c not in (None, 0)]
        if failed:
            logger.error("worker(s) exited with an error (rank, exit code): %s", failed)
            return 1
        if all(c == 0 for c in codes):
            return 0
