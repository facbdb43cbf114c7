"""Worker processes: two "nodes" on 127.0.0.1 (headless node 1), bad node flags, no orphans."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from minivllm import LLM
from minivllm.worker.launcher import _free_port
from tests._parallel_helpers import (TINY, engine_kwargs, greedy_run, live_children, prompts,
                                     wait_until_gone)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_leftover_workers():
    assert live_children() == []
    yield
    assert wait_until_gone([p.pid for p in live_children()]) == []


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}


# ~11 s (four ranks over two launched nodes): in the slow suite, which keeps the default suite
# under 15 minutes on 2 cores; the launcher's single-node paths stay in the default one.
@pytest.mark.slow
def test_two_nodes_on_localhost_match_single_process(tiny_llama_factory):
    path = tiny_llama_factory("dist_tiny", **TINY)
    ref_tokens, ref_logprobs = greedy_run(LLM(model=path, **engine_kwargs()), prompts())
    port = _free_port()
    # TP=2 x PP=2 over 2 nodes: node 1 holds the last stage, so its output is relayed by rank 0.
    flags = ["--model", path, "--dtype", "float32", "--block-size", "4", "-tp", "2", "-pp", "2",
             "--num-gpu-blocks-override", "256",
             "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "minivllm.entrypoints.cli", "serve",
                              *flags, "--node-rank", "1"], env=_env())
    try:
        llm = LLM(model=path, tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                  node_rank=0, master_port=port, **engine_kwargs())
        assert len(llm.executor.workers) == 2             # only node 0's ranks are local
        tokens, logprobs = greedy_run(llm, prompts())
        llm.shutdown()
        assert node1.wait(timeout=30) == 0                # the job ended: node 1 exits cleanly
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert tokens == ref_tokens
    assert (logprobs - ref_logprobs).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_node_started_with_other_flags_fails_clearly(tiny_llama_factory):
    path = tiny_llama_factory("dist_tiny", **TINY)
    port = _free_port()
    node1 = subprocess.Popen([sys.executable, "-m", "minivllm.entrypoints.cli", "serve",
                              "--model", path, "--dtype", "float32", "--block-size", "8",
                              "-pp", "2", "--nnodes", "2", "--node-rank", "1",
                              "--master-port", str(port)], env=_env(), stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(RuntimeError, match=r"block_size=8 \(node 0: 4\)"):
            LLM(model=path, pipeline_parallel_size=2, nnodes=2, master_port=port, **engine_kwargs())
        assert node1.wait(timeout=30) != 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


_SCRIPT = textwrap.dedent("""
    import sys, time
    from minivllm import LLM
    llm = LLM(model=sys.argv[1], dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=128)
    print(" ".join(str(h.proc.pid) for h in llm.executor.workers), flush=True)
    if sys.argv[2] == "hang":
        time.sleep(600)
""")   # no shutdown, no `if __name__ == "__main__"` guard


@pytest.mark.parametrize("how", ["exit", pytest.param("sigkill", marks=pytest.mark.slow)])
def test_no_orphans_when_the_engine_process_ends(tiny_llama_factory, how):
    path = tiny_llama_factory("dist_tiny", **TINY)
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, path, "hang" if how == "sigkill" else how],
                            stdout=subprocess.PIPE, text=True, env=_env())
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        if how == "sigkill":
            proc.send_signal(signal.SIGKILL)      # no finalizer runs: workers notice the parent is gone
        assert proc.wait(timeout=60) in (0, -signal.SIGKILL)
        assert wait_until_gone(pids, timeout_s=10) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
