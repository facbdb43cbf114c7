"""`minivllm bench throughput`: offline throughput as in `vllm bench throughput`, or transformers' `generate`.

Both backends get the same token-id prompts, decode greedily and produce exactly `--output-len`
tokens per request (eos ignored). The timed region is generation only: loading and a short warm-up
are outside it. `--compare` runs both backends in one process and prints minivllm / transformers.
"""

import argparse
import os
import time
from dataclasses import dataclass, field

from minivllm.benchmarks.backends import (Checkpoint, add_backend_args, backends_to_run, write_summary,
                                          hf_generate, hf_pad_token_id, load_hf_model, load_tokenizer,
                                          make_llm, maybe_profile, release, resolve_checkpoint)
from minivllm.benchmarks.datasets import SampleRequest, add_dataset_args, get_requests, sample_random_requests

# Batch sizes tried for transformers when --hf-max-batch-size is not given, largest first, until
# one is slower than the best so far; the best one is kept.
HF_BATCH_SIZES = (1, 8, 16, 32, 64)


@dataclass
class ThroughputResult:
    backend: str
    elapsed_time: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        total = self.num_prompt_tokens + self.num_output_tokens
        return {"backend": self.backend, "elapsed_time": self.elapsed_time,
                "num_requests": self.num_requests, "total_num_tokens": total,
                "num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens,
                "requests_per_second": self.num_requests / self.elapsed_time,
                "tokens_per_second": total / self.elapsed_time,
                "output_tokens_per_second": self.num_output_tokens / self.elapsed_time, **self.extra}


def add_throughput_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_dataset_args(parser)
    parser.add_argument("--hf-max-batch-size", type=int, default=None,
                        help="transformers batch size (default: try "
                             f"{', '.join(map(str, HF_BATCH_SIZES[::-1]))} until one is slower "
                             "than the best so far, and keep the best)")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_backend_args(parser)
    return parser


def run_minivllm(args: argparse.Namespace, requests: list[SampleRequest],
                 warmup: list[SampleRequest]) -> ThroughputResult:
    from minivllm.sampling_params import SamplingParams

    llm = make_llm(args)
    try:
        def params(req: SampleRequest) -> SamplingParams:
            return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=req.expected_output_len,
                                  detokenize=not args.disable_detokenize)

        llm.generate([r.prompt_token_ids for r in warmup], [params(r) for r in warmup], use_tqdm=False)
        prompts = [r.prompt_token_ids for r in requests]
        sampling = [params(r) for r in requests]
        with maybe_profile(args, "minivllm-throughput"):
            start = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=not args.disable_tqdm)
            elapsed = time.perf_counter() - start
    finally:
        release(llm)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return ThroughputResult("minivllm", elapsed, len(requests),
                            sum(r.prompt_len for r in requests), num_output)


def run_hf(args: argparse.Namespace, ckpt: Checkpoint, tokenizer, requests: list[SampleRequest],
           warmup: list[SampleRequest]) -> ThroughputResult:
    """transformers at its best batch size: each candidate runs all requests, the fastest is kept."""
    if args.hf_max_batch_size is not None and args.hf_max_batch_size < 1:
        raise ValueError(f"hf_max_batch_size must be at least 1, got {args.hf_max_batch_size}")
    model = load_hf_model(ckpt)
    try:
        pad = hf_pad_token_id(tokenizer, model)
        hf_generate(model, [r.prompt_token_ids for r in warmup], warmup[0].expected_output_len, pad)
        sweep: dict[int, float] = {}
        best = (0.0, 0, 0)   # (elapsed, num_output, batch_size)
        for batch_size in _hf_batch_sizes(args.hf_max_batch_size, len(requests)):
            elapsed, num_output = _hf_pass(model, requests, batch_size, pad)
            sweep[batch_size] = num_output / elapsed
            print(f"[hf] batch size {batch_size}: {sweep[batch_size]:.2f} output tokens/s", flush=True)
            if best[2] and sweep[batch_size] < sweep[best[2]]:
                break   # NOTE: throughput is unimodal in the batch size; smaller ones only get slower
            best = (elapsed, num_output, batch_size)
    finally:
        release(model)
    elapsed, num_output, batch_size = best
    return ThroughputResult("hf", elapsed, len(requests), sum(r.prompt_len for r in requests), num_output,
                            {"hf_batch_size": batch_size,
                             "hf_output_tokens_per_second_by_batch_size": sweep})


def _hf_batch_sizes(max_batch_size: int | None, num_requests: int) -> list[int]:
    """The given size, or HF_BATCH_SIZES (capped at the request count) from the largest down."""
    if max_batch_size is not None:
        return [max_batch_size]
    return sorted({min(b, num_requests) for b in HF_BATCH_SIZES}, reverse=True)


def _hf_pass(model, requests: list[SampleRequest], batch_size: int, pad: int) -> tuple[float, int]:
    """Consecutive chunks of `batch_size` requests, in order (as vLLM's HF backend batches them)."""
    start = time.perf_counter()
    num_output = 0
    for i in range(0, len(requests), batch_size):
        chunk = requests[i:i + batch_size]
        out = hf_generate(model, [r.prompt_token_ids for r in chunk],
                          max(r.expected_output_len for r in chunk), pad)
        num_output += out.numel()
    return time.perf_counter() - start, num_output


def run_throughput(args: argparse.Namespace) -> dict:
    """Runs the chosen backend(s); prints vLLM's summary line per backend; returns the results."""
    load_at_start = os.getloadavg()[0]
    backends = backends_to_run(args)
    ckpt = resolve_checkpoint(args)
    tokenizer = load_tokenizer(ckpt)
    requests = get_requests(args, tokenizer)
    warmup = sample_random_requests(tokenizer, 2, 16, 4, seed=args.seed + 1)
    results: dict = {}
    for backend in backends:
        if backend == "minivllm":
            result = run_minivllm(args, requests, warmup)
        else:
            result = run_hf(args, ckpt, tokenizer, requests, warmup)
        results[backend] = result.to_dict()
        _print_result(results[backend], label=f"[{backend}] " if len(backends) > 1 else "")
    if len(backends) > 1:
        ratio = results["minivllm"]["output_tokens_per_second"] / results["hf"]["output_tokens_per_second"]
        results["output_throughput_ratio"] = ratio
        print(f"minivllm / transformers (batch {results['hf']['hf_batch_size']}): "
              f"{ratio:.2f}x output tokens/s")
    return write_summary(results, backends, load_at_start, args.output_json)


def _print_result(r: dict, label: str) -> None:
    print(f"{label}Throughput: {r['requests_per_second']:.2f} requests/s, "
          f"{r['tokens_per_second']:.2f} total tokens/s, {r['output_tokens_per_second']:.2f} output tokens/s")
    print(f"{label}Total num prompt tokens:  {r['num_prompt_tokens']}")
    print(f"{label}Total num output tokens:  {r['num_output_tokens']}", flush=True)
