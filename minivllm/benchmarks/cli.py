"""`minivllm bench {throughput,latency,spec-decode,moe,startup,serve,make-gguf}`: the parsers, under the `minivllm` command."""

import argparse
import sys

from minivllm.benchmarks.gguf_variants import add_make_gguf_args, run_make_gguf
from minivllm.benchmarks.latency import add_latency_args, run_latency
from minivllm.benchmarks.moe import add_moe_args, run_moe
from minivllm.benchmarks.spec_decode import add_spec_decode_args, run_spec_decode
from minivllm.benchmarks.startup import add_startup_args, run_startup
from minivllm.benchmarks.throughput import add_throughput_args, run_throughput


def _cmd_throughput(args: argparse.Namespace) -> int:
    run_throughput(args)
    return 0


def _cmd_latency(args: argparse.Namespace) -> int:
    run_latency(args)
    return 0


def _cmd_spec_decode(args: argparse.Namespace) -> int:
    run_spec_decode(args)
    return 0


def _cmd_moe(args: argparse.Namespace) -> int:
    run_moe(args)
    return 0


def _cmd_startup(args: argparse.Namespace) -> int:
    run_startup(args)
    return 0


def _cmd_make_gguf(args: argparse.Namespace) -> int:
    run_make_gguf(args)
    return 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `bench` and its sub-commands to the `minivllm` sub-parsers; returns the `bench` parser."""
    bench = subparsers.add_parser("bench", help="benchmark throughput, latency or a running server")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    throughput = sub.add_parser("throughput", help="offline throughput on a random dataset "
                                "(as `vllm bench throughput`); --backend hf runs transformers")
    add_throughput_args(throughput)
    throughput.set_defaults(func=_cmd_throughput)
    latency = sub.add_parser("latency", help="one batch end to end: prompt and decode tokens/s; "
                             "--compare llama.cpp against llama.cpp on the same GGUF file")
    add_latency_args(latency)
    latency.set_defaults(func=_cmd_latency)
    spec = sub.add_parser("spec-decode", help="chat prompts at batch 1 with and without "
                          "speculative decoding (--speculative-config, default n-gram): decode "
                          "tokens/s, acceptance length, agreement")
    add_spec_decode_args(spec)
    spec.set_defaults(func=_cmd_spec_decode)
    moe = sub.add_parser("moe", help="a random MoE model with real MoE layer shapes (default "
                         "Qwen3-30B-A3B's): batch-1 decode and a batch against transformers, "
                         "with the active-parameter bandwidth floor")
    add_moe_args(moe)
    moe.set_defaults(func=_cmd_moe)
    startup = sub.add_parser("startup", help="a cold `minivllm generate` in a fresh process: wall "
                             "time and peak RSS; --compare llama.cpp against a cold llama.cpp run")
    add_startup_args(startup)
    startup.set_defaults(func=_cmd_startup)
    make_gguf = sub.add_parser("make-gguf", help="write a re-quantized GGUF variant (Q8_0, Q4_K, "
                               "...) of a GGUF model, for the latency comparisons")
    add_make_gguf_args(make_gguf)
    make_gguf.set_defaults(func=_cmd_make_gguf)
    _add_serve(sub)
    return bench


def _add_serve(sub) -> None:
    # NOTE: the serving benchmark lives in its own module (HTTP client dependencies); a missing
    # module keeps the other sub-commands working and says so only when `serve` is asked for.
    try:
        from minivllm.benchmarks.serve import add_serve_bench_args, run_serve_bench
    except ImportError as err:
        reason = str(err)
        serve = sub.add_parser("serve", help="benchmark a running server (unavailable)")

        def unavailable(args: argparse.Namespace) -> int:
            print(f"error: `minivllm bench serve` is unavailable: {reason}", file=sys.stderr)
            return 1

        serve.set_defaults(func=unavailable)
        return
    serve = sub.add_parser("serve", help="benchmark a running OpenAI-compatible server")
    add_serve_bench_args(serve)

    def run(args: argparse.Namespace) -> int:
        run_serve_bench(args)
        return 0

    serve.set_defaults(func=run)
