"""`minivllm bench serve`: N concurrent streaming clients against a running server.

Each client sends a random-token prompt of --input-len tokens to /v1/completions with
ignore_eos and max_tokens=--output-len, and timestamps every streamed chunk. Reported as vLLM's
`bench serve` does: TTFT (time to first token), TPOT (time per output token after the first,
per request), ITL (time between consecutive chunks) and E2EL, as mean / p50 / p90 / p99 in ms,
plus request and token throughput. `--compare-offline` runs the same workload through the
offline engine and a server it starts itself (`serve_compare.py`), and reports the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx
import numpy as np

from minivllm.benchmarks.backends import release
from minivllm.benchmarks.serve_compare import (RequestResult, cpu_per_1k_tokens,
                                               launched_server, offline_vocab_and_engine,
                                               process_cpu_s, run_offline)
from minivllm.benchmarks.sse_client import HTTPStatusError, post_sse
from minivllm.engine.arg_utils import EngineArgs
from minivllm.sampling_params import StructuredOutputsParams

# Text whose tokens seed the random prompts (any words will do: only the token ids are sent).
_CORPUS = ("the of and to in is was for on that with as by at from his her an which are this "
           "be had not but have one were all their they there been has more when will who would "
           "time year people world city water house music river school system number point "
           "small large early found known called since between during under several second")


# `--structured-output json_schema`: every request constrained by this small schema (a name and
# free-text tags, so that the output is not over after a few tokens).
BENCH_JSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"]}
_STRUCTURED_CHOICES = ("none", "json_schema")
T = TypeVar("T")


def add_serve_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    # NOTE: the engine flags are those of `serve`; --model is also the served model name and
    # --seed also seeds the prompts.
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--compare-offline", action="store_true",
                        help="run the workload through the offline engine, then start `minivllm "
                        "serve` with the same engine flags (--model: the model to load) and run "
                        "it again over HTTP; reports both and the served/offline ratio")
    parser.add_argument("--num-rounds", type=int, default=1,
                        help="with --compare-offline: alternate this many offline and served "
                        "rounds (each on new prompts); the ratio is their median")
    parser.add_argument("--base-url", default=None,
                        help="server URL, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at once (default: all of --num-prompts)")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--structured-output", default="none", choices=_STRUCTURED_CHOICES,
                        help="json_schema: every request has a response_format json_schema "
                        "(BENCH_JSON_SCHEMA)")
    parser.add_argument("--result-json", default=None, help="also write the figures to this file")
    return parser


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}.")
    if args.num_rounds < 1:
        raise ValueError(f"--num-rounds must be at least 1, got {args.num_rounds}.")
    if args.structured_output not in _STRUCTURED_CHOICES:
        raise ValueError(f"--structured-output must be one of {', '.join(_STRUCTURED_CHOICES)}.")
    if args.compare_offline:
        result = _compare_offline(args)
    else:
        base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
        result = run_client(_benchmark(args, base_url, args.model))
        print_result(result)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def run_client(coro: Coroutine[Any, Any, T]) -> T:
    """Runs the benchmark client on uvloop when it is installed (uvicorn[standard] brings it):
    the client shares the cores with the server it measures, and uvloop's streams cost it ~a
    third less CPU per streamed token than asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _compare_offline(args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of the offline engine (in this process) then the server (a subprocess), on the same
    prompts; each round draws new prompts, so neither side hits the other's prefix cache."""
    concurrency = args.max_concurrency or args.num_prompts
    structured = (StructuredOutputsParams(json=BENCH_JSON_SCHEMA)
                  if args.structured_output == "json_schema" else None)
    rounds = []
    with launched_server(args) as server:
        vocab, engine = offline_vocab_and_engine(args, _CORPUS)   # loads while the server does
        try:
            server.wait_until_healthy()
            warmups = random_prompts(vocab, min(concurrency, args.num_prompts), args.input_len,
                                     args.seed + 10_000)
            run_offline(engine, warmups, min(args.output_len, 4), concurrency, structured, "warmup")
            run_client(_benchmark(args, server.url, None, warmups, min(args.output_len, 4)))
            for r in range(args.num_rounds):
                prompts = random_prompts(vocab, args.num_prompts, args.input_len, args.seed + r)
                rounds.append(_one_round(args, engine, server, prompts, structured, f"round{r}"))
                print(f"round {r}: {_round_line(rounds[-1])}", flush=True)
        finally:
            release(engine)
    print_result(rounds[-1]["offline"], "Offline engine")
    print_result(rounds[-1]["served"], "Served")
    ratios = [r["served_vs_offline_output_throughput"] for r in rounds]
    print(f"Served / offline output token throughput: {float(np.median(ratios)):.2f}x (median of "
          f"{len(ratios)} rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    summary = {**rounds[-1], "rounds": rounds, "median_served_vs_offline": float(np.median(ratios))}
    cpu = [(r["offline"]["cpu_s_per_1k_output_tokens"], r["served"]["cpu_s_per_1k_output_tokens"])
           for r in rounds]
    if all(served for _, served in cpu):
        cpu_ratio = float(np.median([offline / served for offline, served in cpu]))
        print(f"Offline / server CPU seconds per output token: {cpu_ratio:.2f}x (median; what "
              "served / offline tok/s would be with the cores to spare)")
        summary["median_offline_vs_server_cpu_per_token"] = cpu_ratio
    return summary


def _one_round(args: argparse.Namespace, engine: Any, server: Any, prompts: list[list[int]],
               structured: Any, tag: str) -> dict[str, Any]:
    """The offline engine, then the server, on `prompts`; with the CPU seconds each side spent
    per 1k output tokens (steadier than tok/s on a shared host: waiting for a core is not
    counted; the client's own share is reported apart, it would run elsewhere)."""
    concurrency = args.max_concurrency or args.num_prompts
    cpu_start = time.process_time()
    results, duration = run_offline(engine, prompts, args.output_len, concurrency, structured, tag)
    offline = summarize(results, duration, concurrency)
    offline["cpu_s_per_1k_output_tokens"] = cpu_per_1k_tokens(
        time.process_time() - cpu_start, offline["total_output_tokens"])
    server_start, client_start = process_cpu_s(server.process.pid), time.process_time()
    served = run_client(_benchmark(args, server.url, None, prompts))
    server_end = process_cpu_s(server.process.pid)
    num_tokens = served["total_output_tokens"]
    served["cpu_s_per_1k_output_tokens"] = cpu_per_1k_tokens(
        None if server_start is None else server_end - server_start, num_tokens)
    served["client_cpu_s_per_1k_output_tokens"] = cpu_per_1k_tokens(
        time.process_time() - client_start, num_tokens)
    ratio = served["output_throughput"] / offline["output_throughput"] \
        if offline["output_throughput"] else 0.0
    return {"offline": offline, "served": served, "served_vs_offline_output_throughput": ratio}


def _round_line(r: dict[str, Any]) -> str:
    offline, served = r["offline"], r["served"]
    line = (f"served {served['output_throughput']:.1f} tok/s, offline "
            f"{offline['output_throughput']:.1f} tok/s: {r['served_vs_offline_output_throughput']:.2f}x")
    if served["cpu_s_per_1k_output_tokens"] is not None:
        line += (f"; CPU s per 1k tokens: server {served['cpu_s_per_1k_output_tokens']:.2f}, "
                 f"offline {offline['cpu_s_per_1k_output_tokens']:.2f}, client "
                 f"{served['client_cpu_s_per_1k_output_tokens']:.2f}")
    return line


async def _benchmark(args: argparse.Namespace, base_url: str, model: str | None,
                     prompts: list[list[int]] | None = None,
                     output_len: int | None = None) -> dict[str, Any]:
    """One timed round of `prompts` (default: drawn from the server's /tokenize)."""
    concurrency = args.max_concurrency or args.num_prompts
    # httpx for the set-up calls; the streamed requests use post_sse (sse_client.py).
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None)) as client:
        model = model or await _first_model(client)
        if prompts is None:
            vocab = await _prompt_vocab(client, model)
            prompts = random_prompts(vocab, args.num_prompts, args.input_len, args.seed)
        semaphore = asyncio.Semaphore(concurrency)
        extra = _structured_body(args.structured_output)

        async def limited(prompt: list[int], output_len: int) -> RequestResult:
            async with semaphore:
                return await _one_request(base_url, model, prompt, output_len, extra)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p, output_len or args.output_len)
                                         for p in prompts))
        duration = time.perf_counter() - start
    return summarize(results, duration, concurrency)


def _structured_body(structured_output: str) -> dict[str, Any]:
    if structured_output == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "bench", "schema": BENCH_JSON_SCHEMA}}}
    return {}


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _prompt_vocab(client: httpx.AsyncClient, model: str) -> list[int]:
    response = await client.post("/tokenize", json={"model": model, "prompt": " " + _CORPUS,
                                                    "add_special_tokens": False})
    response.raise_for_status()
    return sorted(set(response.json()["tokens"]))


def random_prompts(vocab: list[int], num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Random sequences of ordinary-word tokens: exact lengths, and no shared prefixes."""
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(input_len)] for _ in range(num_prompts)]


async def _one_request(base_url: str, model: str, prompt: list[int], output_len: int,
                       extra: dict[str, Any]) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}
    result = RequestResult(prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async for data in post_sse(base_url, "/v1/completions", body):
            if data == "[DONE]":
                break
            # Only the usage chunk and errors are parsed: timing a token chunk needs no JSON.
            if '"choices":[]' in data or '"choices": []' in data or data.startswith('{"error"'):
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "stream error")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                continue
            now = time.perf_counter()
            if result.ttft_s == 0.0:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
        result.latency_s = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage in the stream"
    except (OSError, HTTPStatusError, ValueError, asyncio.IncompleteReadError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def summarize(results: list[RequestResult], duration_s: float, concurrency: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "max_concurrency": concurrency,
        "duration_s": duration_s, "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name, values in (("ttft", [r.ttft_s for r in ok]), ("tpot", tpots),
                         ("itl", [x for r in ok for x in r.itl_s]),
                         ("e2el", [r.latency_s for r in ok])):
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        summary[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        for p in (50, 90, 99):
            summary[f"p{p}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return summary


def print_result(s: dict[str, Any], title: str = "Serving Benchmark Result") -> None:
    line = "=" * 50
    print(f"{line}\n{' ' + title + ' ':=^50}")
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Maximum request concurrency:", s["max_concurrency"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value:>10}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in titles.items():
        print(f"{' ' + title + ' ':-^50}")
        print(f"{'Mean ' + key.upper() + ' (ms):':<40}{s[f'mean_{key}_ms']:>10.2f}")
        for p in (50, 90, 99):
            print(f"{f'P{p} ' + key.upper() + ' (ms):':<40}{s[f'p{p}_{key}_ms']:>10.2f}")
    for error in s["errors"]:
        print(f"error: {error}")
    print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_serve_bench_args(parser)
    run_serve_bench(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
