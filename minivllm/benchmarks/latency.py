"""`minivllm bench latency`: one batch (default: a single request) end to end; prompt and decode tok/s.

Prompt (prefill) tok/s = prompt tokens / time to the first token of every request; decode tok/s =
the remaining generated tokens / the time after it. Every iteration uses fresh random prompts, so
the prefix cache never serves a prompt. `--compare` runs transformers too; `--compare llama.cpp`
runs llama.cpp on the same GGUF file (batch 1, rounds alternating in one process, see
`run_llama_cpp_compare`).
"""

import argparse
import contextlib
import functools
import multiprocessing
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from minivllm.benchmarks.backends import (Checkpoint, add_backend_args, hf_generate, hf_pad_token_id,
                                          load_hf_model, make_engine, maybe_profile, release, report,
                                          start_benchmark)
from minivllm.benchmarks.datasets import SampleRequest, sample_random_requests
from minivllm.benchmarks.llama_cpp import (LlamaCppModel, import_llama_cpp, llama_cpp_peak_rss,
                                           peak_rss_bytes, time_llama_cpp)
from minivllm.benchmarks.roofline import bandwidth_floor
from minivllm.sampling_params import SamplingParams
from minivllm.transformers_utils.config import is_gguf


COMPARE_WITH = ("hf", "llama.cpp")
DEFAULT_NUM_ITERS = 3
DEFAULT_LLAMA_CPP_ROUNDS = 5


@dataclass
class IterTiming:
    prefill_time: float   # start -> every request has its first token
    total_time: float     # start -> every request finished
    token_ids: list[list[int]] | None = None   # per request, the generated ids (not from hf)


def add_latency_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=None,
                        help=f"measured iterations (default {DEFAULT_NUM_ITERS}; with --compare "
                             f"llama.cpp, {DEFAULT_LLAMA_CPP_ROUNDS} rounds of both backends)")
    parser.add_argument("--background-load", type=int, default=0, metavar="N",
                        help="run N busy processes (one spinning core each) beside the timed "
                             "rounds: how decode holds up when the cores are shared")
    add_backend_args(parser)
    _compare_with_a_backend(parser)
    return parser


@contextlib.contextmanager
def background_load(count: int) -> Iterator[None]:
    """`count` processes that each keep one core busy (a Python spin loop) while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(count)]
    try:
        if procs:
            print(f"[load] {count} busy process(es) beside the timed rounds", flush=True)
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def _compare_with_a_backend(parser: argparse.ArgumentParser) -> None:
    """`--compare` alone: transformers, as in the other benchmarks; `--compare llama.cpp`."""
    # NOTE: add_backend_args defines --compare as a flag for every benchmark; only this one also
    # compares with llama.cpp, so a group that resolves conflicts replaces the flag (the old
    # action is removed, not shadowed).
    group = parser.add_argument_group("comparison", conflict_handler="resolve")
    group.add_argument("--compare", nargs="?", const="hf", default=None, choices=COMPARE_WITH,
                       help="run minivllm and transformers (hf, the default) or llama.cpp "
                            "(a GGUF --model, batch 1; needs `pip install llama-cpp-python`) "
                            "in this process and print the ratio")


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

    finished = engine.run_until_finished(request_ids, on_output)
    return IterTiming(first_token_at[0] - start, time.perf_counter() - start,
                      [list(output.outputs[0].token_ids) for output in finished])


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
    check_latency_args(args)
    if args.compare == "llama.cpp":
        return run_llama_cpp_compare(args)
    start = start_benchmark(args)
    num_batches = args.num_iters_warmup + args.num_iters
    flat = sample_random_requests(start.tokenizer, num_batches * args.batch_size, args.input_len,
                                  args.output_len, 0.0, args.seed)
    batches = [flat[i * args.batch_size:(i + 1) * args.batch_size] for i in range(num_batches)]
    results: dict = {}
    for backend in start.backends:
        with background_load(args.background_load):
            timings = time_minivllm(args, batches) if backend == "minivllm" else \
                time_hf(args, start.ckpt, start.tokenizer, batches)
        results[backend] = summarize(backend, timings[args.num_iters_warmup:], args.batch_size,
                                     args.input_len, args.output_len)
        results[backend]["background_load"] = args.background_load
    return report(results, _print_result, _compare, start.load_at_start, args.output_json,
                  always_label=True)


def check_latency_args(args: argparse.Namespace) -> None:
    """Validates the counts and fills in --num-iters' default (it depends on --compare)."""
    if args.num_iters is None:
        args.num_iters = DEFAULT_LLAMA_CPP_ROUNDS if args.compare == "llama.cpp" else DEFAULT_NUM_ITERS
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup must be at least 0, got {args.num_iters_warmup}")
    if args.background_load < 0:
        raise ValueError(f"background_load must be at least 0, got {args.background_load}")


def run_llama_cpp_compare(args: argparse.Namespace) -> dict:
    """minivllm against llama.cpp on one GGUF file: batch 1, the same prompt ids, greedy with eos
    ignored, the same thread count; both loaded at once, one round of each per prompt, the order
    swapped every other round (a drifting host favours neither). Then the bandwidth floor, and
    each backend's peak RSS from a fresh process."""
    import_llama_cpp("--compare llama.cpp")      # before anything loads
    if args.batch_size != 1 or args.output_len < 2:
        raise ValueError("--compare llama.cpp times one sequence decoding at least 2 tokens; got "
                         f"--batch-size {args.batch_size}, --output-len {args.output_len}")
    start = start_benchmark(args)
    model = start.ckpt.model
    if not is_gguf(model):
        raise ValueError(f"--compare llama.cpp needs a .gguf --model (all llama.cpp reads), got "
                         f"{model!r}; `minivllm bench make-gguf` writes variants of one")
    n_ctx = args.input_len + args.output_len
    _size_kv_cache(args, n_ctx)
    num_rounds = args.num_iters_warmup + args.num_iters
    prompts = [r.prompt_token_ids for r in sample_random_requests(
        start.tokenizer, num_rounds, args.input_len, args.output_len, 0.0, args.seed)]
    with background_load(args.background_load):
        runs = _alternate_rounds(args, model, prompts, n_ctx)
    measured = {b: t[args.num_iters_warmup:] for b, t in runs.items()}
    results = {b: {**_summarize_rounds(b, t, args), "background_load": args.background_load}
               for b, t in measured.items()}
    extras = {"greedy_agreement": [_common_prefix(m.token_ids[0], c.token_ids[0]) for m, c in
                                   zip(measured["minivllm"], measured["llama.cpp"])],
              "bandwidth_floor": bandwidth_floor(model),
              "peak_rss": _peak_rss(args, model, prompts[0], n_ctx)}
    return report(results, _print_round_result, functools.partial(_compare_llama_cpp, extras),
                  start.load_at_start, args.output_json, always_label=True)


def _size_kv_cache(args: argparse.Namespace, n_ctx: int) -> None:
    """Unless flags sized it, minivllm's KV cache holds llama.cpp's n_ctx tokens (like for like in
    the peak RSS), or what --max-model-len needs when given (it defaults to n_ctx here)."""
    if args.num_gpu_blocks_override is None and args.kv_cache_memory_bytes is None:
        if args.max_model_len is None:
            args.max_model_len = n_ctx
        args.num_gpu_blocks_override = -(-max(args.max_model_len, n_ctx) // args.block_size)


def _alternate_rounds(args: argparse.Namespace, model: str, prompts: list[list[int]],
                      n_ctx: int) -> dict[str, list[IterTiming]]:
    engine = make_engine(args)
    llm = None
    try:
        llm = LlamaCppModel(model, n_ctx, torch.get_num_threads())
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len,
                                detokenize=False)
        runs: dict[str, list[IterTiming]] = {"minivllm": [], "llama.cpp": []}
        for i, prompt in enumerate(prompts):
            for backend in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
                if backend == "minivllm":
                    runs[backend].append(_time_batch(engine, [SampleRequest(prompt, args.output_len)],
                                                     params, f"vs-llama-{i}"))
                else:
                    r = time_llama_cpp(llm, prompt, args.output_len)
                    runs[backend].append(IterTiming(r.prefill_time, r.total_time, [r.token_ids]))
            if i >= args.num_iters_warmup:
                print(f"[round {i + 1 - args.num_iters_warmup}/{args.num_iters}] decode tokens/s: "
                      + ", ".join(f"{b} {_decode_rate(t[-1], args.output_len):.1f}"
                                  for b, t in runs.items()), flush=True)
    finally:
        release(engine)
        if llm is not None:
            llm.close()
    return runs


def _summarize_rounds(backend: str, timings: list[IterTiming], args: argparse.Namespace) -> dict:
    r = summarize(backend, timings, 1, args.input_len, args.output_len)
    prompt = [args.input_len / t.prefill_time for t in timings]
    decode = [_decode_rate(t, args.output_len) for t in timings]
    r.update(prompt_tokens_per_second_by_round=prompt, decode_tokens_per_second_by_round=decode,
             prompt_tokens_per_second_median=statistics.median(prompt),
             decode_tokens_per_second_median=statistics.median(decode),
             decode_ms_per_token_median=1e3 / statistics.median(decode))
    return r


def _decode_rate(t: IterTiming, output_len: int) -> float:
    return (output_len - 1) / (t.total_time - t.prefill_time)


def _peak_rss(args: argparse.Namespace, model: str, prompt: list[int], n_ctx: int) -> dict:
    threads = torch.get_num_threads()
    # NOTE: spawn, not fork: a forked child's VmHWM starts at this process's resident set.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        mini = pool.submit(_minivllm_peak_rss, args, prompt, threads).result()
    llama = llama_cpp_peak_rss(model, prompt, args.output_len, n_ctx, threads)
    return {"minivllm_bytes": mini, "llama.cpp_bytes": llama, "ratio": mini / llama}


def _minivllm_peak_rss(args: argparse.Namespace, prompt: list[int], threads: int) -> int:
    """In a fresh child: build the engine, run one batch-1 request, return the peak RSS."""
    torch.set_num_threads(threads)
    engine = make_engine(args)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=False)
    _time_batch(engine, [SampleRequest(prompt, args.output_len)], params, "rss")
    peak = peak_rss_bytes()
    release(engine)
    return peak


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _compare_llama_cpp(extras: dict, results: dict) -> str:
    """The ratio lines, greedy agreement, the bandwidth floor and peak RSS (added to `results`)."""
    mini, cpp = results["minivllm"], results["llama.cpp"]
    ratios = {k: [m / c for m, c in zip(mini[f"{k}_tokens_per_second_by_round"],
                                        cpp[f"{k}_tokens_per_second_by_round"])]
              for k in ("decode", "prompt")}
    results.update(extras, decode_ratios=ratios["decode"], prompt_ratios=ratios["prompt"],
                   decode_ratio=statistics.median(ratios["decode"]),
                   prompt_ratio=statistics.median(ratios["prompt"]))
    floor, rss, agree = extras["bandwidth_floor"], extras["peak_rss"], extras["greedy_agreement"]
    return "\n".join([
        f"minivllm / llama.cpp (median of {len(ratios['decode'])} per-round ratios): decode "
        f"{results['decode_ratio']:.2f}x, prompt {results['prompt_ratio']:.2f}x",
        f"Greedy agreement (common prefix, of {mini['output_len']} tokens, per round): "
        f"{', '.join(map(str, agree))}",
        f"Bandwidth floor: {floor['weight_bytes_per_step'] / 1e6:.1f} MB of GGUF weights per "
        f"decode step / {floor['read_bandwidth_gb_per_s']:.1f} GB/s read "
        f"({floor['torch_num_threads']} threads) = {floor['floor_ms_per_step']:.2f} ms/step, "
        f"at most {floor['max_decode_tokens_per_second']:.0f} tokens/s",
        f"Peak RSS of a batch-1 run, each in a fresh process: minivllm "
        f"{rss['minivllm_bytes'] / 2**20:.0f} MiB, llama.cpp {rss['llama.cpp_bytes'] / 2**20:.0f} "
        f"MiB ({rss['ratio']:.2f}x)"])


def _print_round_result(r: dict, label: str) -> None:
    rounds = ", ".join(f"{x:.1f}" for x in r["decode_tokens_per_second_by_round"])
    print(f"{label}Prompt: {r['prompt_tokens_per_second_median']:.1f} tokens/s, decode: "
          f"{r['decode_tokens_per_second_median']:.1f} tokens/s "
          f"({r['decode_ms_per_token_median']:.2f} ms/token; medians of {r['num_iters']} rounds of "
          f"{r['input_len']} in, {r['output_len']} out; decode by round: {rounds})", flush=True)


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
