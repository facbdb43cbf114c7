"""`minivllm bench serve`: N concurrent streaming clients against a running server.

Each client sends a random-token prompt of --input-len tokens to /v1/completions with
ignore_eos and max_tokens=--output-len, and timestamps every streamed chunk. Reported as vLLM's
`bench serve` does: TTFT (time to first token), TPOT (time per output token after the first,
per request), ITL (time between consecutive chunks) and E2EL, as mean / p50 / p90 / p99 in ms,
plus request and token throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

# Text whose tokens seed the random prompts (any words will do: only the token ids are sent).
_CORPUS = ("the of and to in is was for on that with as by at from his her an which are this "
           "be had not but have one were all their they there been has more when will who would "
           "time year people world city water house music river school system number point "
           "small large early found known called since between during under several second")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def add_serve_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default=None,
                        help="server URL, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None,
                        help="the served model name (default: the first one /v1/models lists)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at once (default: all of --num-prompts)")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None, help="also write the figures to this file")
    return parser


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}.")
    result = asyncio.run(_benchmark(args))
    print_result(result)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


async def _benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    concurrency = args.max_concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.model or await _first_model(client)
        prompts = await _random_prompts(client, model, args.num_prompts, args.input_len, args.seed)
        semaphore = asyncio.Semaphore(concurrency)

        async def limited(prompt: list[int]) -> RequestResult:
            async with semaphore:
                return await _one_request(client, model, prompt, args.output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - start
    return summarize(results, duration, concurrency)


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _random_prompts(client: httpx.AsyncClient, model: str, num_prompts: int,
                          input_len: int, seed: int) -> list[list[int]]:
    """Random sequences of ordinary-word tokens: exact lengths, and no shared prefixes."""
    response = await client.post("/tokenize", json={"model": model, "prompt": " " + _CORPUS,
                                                    "add_special_tokens": False})
    response.raise_for_status()
    vocab = sorted(set(response.json()["tokens"]))
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(input_len)] for _ in range(num_prompts)]


async def _one_request(client: httpx.AsyncClient, model: str, prompt: list[int],
                       output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "stream error")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
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
    except httpx.HTTPError as exc:
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


def print_result(s: dict[str, Any]) -> None:
    line = "=" * 50
    print(f"{line}\n{' Serving Benchmark Result ':=^50}")
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
