"""`minivllm bench serve --compare-offline`: the same workload through the offline engine and
through a `minivllm serve` subprocess started with the same engine flags.

The offline side keeps at most --max-concurrency requests in the engine at once (a new one is
added when one finishes), as the HTTP clients do, and timestamps each engine step's outputs, so
TTFT/TPOT/ITL mean the same on both sides. Both sides first run one untimed warm-up round on
other prompts (CPU graphs are captured per batch size; other prompts keep the prefix cache cold).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import httpx

from minivllm.benchmarks.backends import make_engine
from minivllm.engine.arg_utils import EngineArgs
from minivllm.sampling_params import SamplingParams

_SERVER_START_TIMEOUT_S = 600.0


@dataclasses.dataclass
class RequestResult:
    """One request's timings, from the HTTP client or from the offline loop."""

    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def engine_cli_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` that differ from EngineArgs' defaults, as `serve` takes them."""
    flags: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name, f.default)
        if value == f.default:
            continue
        name = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [name, json.dumps(value)]
        else:
            flags += [name, str(value)]
    return flags


def offline_vocab_and_engine(args: argparse.Namespace, corpus: str) -> tuple[list[int], Any]:
    """The offline engine built from the flags, and the prompt vocabulary as /tokenize gives it."""
    engine = make_engine(args)
    vocab = sorted(set(engine.tokenizer.encode(" " + corpus, add_special_tokens=False)))
    return vocab, engine


def run_offline(engine: Any, prompts: list[list[int]], output_len: int, concurrency: int,
                structured: Any = None, tag: str = "bench") -> tuple[list[RequestResult], float]:
    """One timed round over `prompts`; returns the results and the duration."""
    start = time.perf_counter()
    results = _offline_round(engine, prompts, output_len, concurrency, structured, tag)
    return results, time.perf_counter() - start


def _offline_round(engine: Any, prompts: list[list[int]], output_len: int, concurrency: int,
                   structured: Any, tag: str) -> list[RequestResult]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                            structured_outputs=structured)
    results = [RequestResult(prompt_tokens=len(p)) for p in prompts]
    pending = deque(range(len(prompts)))
    start_s: dict[int, float] = {}
    last_s: dict[int, float] = {}
    num_in_flight = 0
    while pending or num_in_flight:
        while pending and num_in_flight < concurrency:
            i = pending.popleft()
            start_s[i] = time.perf_counter()
            engine.add_request(f"{tag}-{i}", prompts[i], params)
            num_in_flight += 1
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            i = int(output.request_id.rsplit("-", 1)[1])
            result, num_tokens = results[i], len(output.outputs[0].token_ids)
            if num_tokens > result.output_tokens:
                if result.output_tokens == 0:
                    result.ttft_s = now - start_s[i]
                else:
                    result.itl_s.append(now - last_s[i])
                result.output_tokens, last_s[i] = num_tokens, now
            if output.finished:
                result.latency_s, result.ok = now - start_s[i], num_tokens > 0
                num_in_flight -= 1
    return results


@dataclasses.dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str

    def wait_until_healthy(self, timeout_s: float = _SERVER_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"The server exited with status {self.process.returncode} "
                                   "while starting.")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"The server did not become healthy within {timeout_s:.0f} s.")


@contextlib.contextmanager
def launched_server(args: argparse.Namespace) -> Iterator[ServerProcess]:
    """`minivllm serve` with the engine flags of `args` on a free loopback port, starting in the
    background (call `wait_until_healthy`); stopped on exit."""
    port = _free_port()
    command = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--uvicorn-log-level", "warning", *engine_cli_flags(args)]
    print(f"Starting the server: minivllm {' '.join(command[3:])}", flush=True)
    process = subprocess.Popen(command, env=dict(os.environ))
    try:
        yield ServerProcess(process, f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far, all threads (Linux /proc; else None)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_1k_tokens(cpu_s: float | None, num_tokens: int) -> float | None:
    return None if cpu_s is None or not num_tokens else cpu_s / num_tokens * 1000.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
