"""`minivllm bench latency`: one batch (default: a single request) end to end; prompt and decode tok/s.

Prompt (prefill) tok/s = prompt tokens / time to the first token of every request; decode tok/s =
the remaining generated tokens / the time after it. Every iteration uses fresh random prompts, so
the prefix cache never serves a prompt.
"""

import argparse
import statistics
import time
from dataclasses import dataclass

from minivllm.benchmarks.backends import (Checkpoint, add_backend_args, hf_generate, hf_pad_token_id,
                                          load_hf_model, make_engine, maybe_profile, release, report,
                                          start_benchmark)
from minivllm.benchmarks.datasets import SampleRequest, sample_random_requests
from minivllm.sampling_params import SamplingParams


@dataclass
class IterTiming:
    prefill_time: float   # start -> every request has its first token
    total_time: float     # start -> every request finished


def add_latency_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3)
    add_backend_args(parser)
    return parser


def time_minivllm(args: argparse.Namespace, batches: list[list[SampleRequest]]) -> list[IterTiming]:
    engine = make_engine(args)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=not args.disable_detokenize)
    timings = []
    try:
        for it, batch in enumerate(batches):
            # --profile covers the first measured iteration only.
            with maybe_profile(args, "minivllm-latency", enabled=it == args.num_iters_warmup):
                timings.append(_time_batch(engine, batch, params, f"lat-{it}"))
    finally:
        release(engine)
    return timings


def _time_batch(engine, batch: list[SampleRequest], params, prefix: str) -> IterTiming:
    """One batch through the engine; the prefill ends when every request has its first token."""
    start = time.perf_counter()
    request_ids = [f"{prefix}-{i}" for i in range(len(batch))]
    for request_id, req in zip(request_ids, batch):
        engine.add_request(request_id, req.prompt_token_ids, params)
    started: set[str] = set()
    first_token_at: list[float] = []

    def on_output(output) -> None:
        if output.outputs[0].token_ids and output.request_id not in started:
            started.add(output.request_id)
            if len(started) == len(batch):
                first_token_at.append(time.perf_counter())

    engine.run_until_finished(request_ids, on_output)
    return IterTiming(first_token_at[0] - start, time.perf_counter() - start)


class _TokenClock:
    """A transformers streamer that only records when each `put` (prompt, then each token) happens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_hf(args: argparse.Namespace, ckpt: Checkpoint, tokenizer,
            batches: list[list[SampleRequest]]) -> list[IterTiming]:
    model = load_hf_model(ckpt)
    pad = hf_pad_token_id(tokenizer, model)
    timings = []
    try:
        for batch in batches:
            clock = _TokenClock()
            start = time.perf_counter()
            hf_generate(model, [r.prompt_token_ids for r in batch], args.output_len, pad, streamer=clock)
            # times[0]: the prompt was handed over; times[1]: the first generated token.
            timings.append(IterTiming(clock.times[1] - start, time.perf_counter() - start))
    finally:
        release(model)
    return timings


def summarize(backend: str, timings: list[IterTiming], batch_size: int, input_len: int,
              output_len: int) -> dict:
    prefill = sum(t.prefill_time for t in timings)
    decode = sum(t.total_time - t.prefill_time for t in timings)
    latencies = [t.total_time for t in timings]
    return {"backend": backend, "batch_size": batch_size, "input_len": input_len,
            "output_len": output_len, "num_iters": len(timings),
            "avg_latency": statistics.mean(latencies), "latencies": latencies,
            "avg_time_to_first_token": prefill / len(timings),
            "prompt_tokens_per_second": batch_size * input_len * len(timings) / prefill,
            "decode_tokens_per_second": (batch_size * (output_len - 1) * len(timings) / decode
                                         if output_len > 1 else float("nan"))}


def run_latency(args: argparse.Namespace) -> dict:
    """Runs the chosen backend(s) on the same prompts; prints a summary per backend (and the ratio)."""
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup must be at least 0, got {args.num_iters_warmup}")
    start = start_benchmark(args)
    num_batches = args.num_iters_warmup + args.num_iters
    flat = sample_random_requests(start.tokenizer, num_batches * args.batch_size, args.input_len,
                                  args.output_len, 0.0, args.seed)
    batches = [flat[i * args.batch_size:(i + 1) * args.batch_size] for i in range(num_batches)]
    results: dict = {}
    for backend in start.backends:
        timings = time_minivllm(args, batches) if backend == "minivllm" else \
            time_hf(args, start.ckpt, start.tokenizer, batches)
        results[backend] = summarize(backend, timings[args.num_iters_warmup:], args.batch_size,
                                     args.input_len, args.output_len)
    return report(results, _print_result, _compare, start.load_at_start, args.output_json,
                  always_label=True)


def _compare(results: dict) -> str:
    mini, hf = results["minivllm"], results["hf"]
    results["decode_ratio"] = mini["decode_tokens_per_second"] / hf["decode_tokens_per_second"]
    results["prompt_ratio"] = mini["prompt_tokens_per_second"] / hf["prompt_tokens_per_second"]
    return (f"minivllm / transformers: decode {results['decode_ratio']:.2f}x, "
            f"prompt {results['prompt_ratio']:.2f}x")


def _print_result(r: dict, label: str) -> None:
    print(f"{label}Avg latency: {r['avg_latency']:.3f} s (batch {r['batch_size']}, "
          f"{r['input_len']} in, {r['output_len']} out, {r['num_iters']} iters)")
    print(f"{label}Prompt: {r['prompt_tokens_per_second']:.2f} tokens/s "
          f"(TTFT {r['avg_time_to_first_token'] * 1000:.1f} ms), "
          f"decode: {r['decode_tokens_per_second']:.2f} tokens/s", flush=True)
