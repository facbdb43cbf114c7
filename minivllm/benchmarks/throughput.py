"""`minivllm bench throughput`: offline throughput as in `vllm bench throughput`, or transformers' `generate`.

Both backends get the same token-id prompts, decode greedily and produce exactly `--output-len`
tokens per request (eos ignored). The timed region is generation only: loading and a short warm-up
are outside it. `--compare` runs both backends in one process and prints minivllm / transformers;
`--rounds N` repeats the workload on fresh prompts, alternating the backends, and reports the median
of the per-round ratios.
"""

import argparse
import itertools
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from minivllm.benchmarks.backends import (Checkpoint, add_backend_args, hf_generate, hf_pad_token_id,
                                          load_hf_model, make_engine, maybe_profile, release, report,
                                          start_benchmark)
from minivllm.benchmarks.datasets import SampleRequest, add_dataset_args, get_requests, sample_random_requests
from minivllm.benchmarks.lora_adapters import write_random_adapter
from minivllm.lora.request import LoRARequest
from minivllm.model_executor.layers.quantization import QUANTIZATION_METHODS
from minivllm.sampling_params import SamplingParams

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

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / self.elapsed_time

    @staticmethod
    def pooled(results: list["ThroughputResult"]) -> "ThroughputResult":
        """Several runs as one: summed times and tokens; the last run's extras plus each run's
        output tokens/s."""
        last = results[-1]
        extra = dict(last.extra)
        if len(results) > 1:
            extra["output_tokens_per_second_by_round"] = [r.output_throughput for r in results]
        return ThroughputResult(last.backend, sum(r.elapsed_time for r in results),
                                sum(r.num_requests for r in results),
                                sum(r.num_prompt_tokens for r in results),
                                sum(r.num_output_tokens for r in results), extra)

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
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the workload this many times, each round on fresh prompts (seed "
                             "+ round); with --compare both backends stay loaded and alternate, "
                             "and the ratio is the median of the rounds' ratios, so a slow spell "
                             "of a shared host cannot decide it")
    parser.add_argument("--compare-quantization", default=None,
                        choices=[*QUANTIZATION_METHODS, "none"],
                        help="run minivllm a second time with --quantization METHOD (e.g. none: "
                             "the dequantised weights), alternating rounds as with --compare, "
                             "and print this run's / that run's output tok/s")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--num-loras", type=int, default=0,
                        help="minivllm: spread the requests evenly over this many random LoRA "
                             "adapters (all-linear; turns on --enable-lora with that many slots)")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of those adapters")
    add_backend_args(parser)
    return parser


class MinivllmSession:
    """One engine, warmed up, that runs request lists (each timed on its own)."""

    def __init__(self, args: argparse.Namespace, warmup: list[SampleRequest]) -> None:
        self.args = args
        self._lora_dir: tempfile.TemporaryDirectory | None = None
        if args.num_loras > 0:
            # Every adapter gets a slot: a step may hold requests of all of them.
            args.enable_lora = True
            args.max_loras = max(args.max_loras, args.num_loras)
            args.max_cpu_loras = max(args.max_cpu_loras or 0, args.max_loras)
            args.max_lora_rank = max(args.max_lora_rank, args.lora_rank)
        self.engine = make_engine(args)
        self.loras = self._make_loras(args.num_loras)
        self._counter = itertools.count()
        self._generate(warmup, use_tqdm=False)

    def _make_loras(self, num_loras: int) -> list[LoRARequest]:
        if num_loras <= 0:
            return []
        self._lora_dir = tempfile.TemporaryDirectory(prefix="minivllm-bench-lora-")
        hf_config = self.engine.vllm_config.model_config.hf_text_config
        loras = []
        for i in range(num_loras):
            folder = write_random_adapter(os.path.join(self._lora_dir.name, f"lora{i}"),
                                          hf_config, self.args.lora_rank, seed=self.args.seed + i)
            loras.append(LoRARequest(f"bench-lora-{i}", i + 1, folder))
            self.engine.add_lora(loras[-1])
        return loras

    def _generate(self, requests: list[SampleRequest], use_tqdm: bool) -> list:
        request_ids = []
        for i, r in enumerate(requests):
            request_ids.append(f"thr-{next(self._counter)}")
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.expected_output_len,
                                    detokenize=not self.args.disable_detokenize)
            lora = self.loras[i % len(self.loras)] if self.loras else None
            self.engine.add_request(request_ids[-1], r.prompt_token_ids, params, lora_request=lora)
        return self.engine.run_until_finished(request_ids, use_tqdm=use_tqdm)

    def run(self, requests: list[SampleRequest]) -> ThroughputResult:
        with maybe_profile(self.args, "minivllm-throughput"):
            start = time.perf_counter()
            outputs = self._generate(requests, use_tqdm=not self.args.disable_tqdm)
            elapsed = time.perf_counter() - start
        num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        extra = {"num_loras": len(self.loras), "lora_rank": self.args.lora_rank} if self.loras else {}
        return ThroughputResult("minivllm", elapsed, len(requests),
                                sum(r.prompt_len for r in requests), num_output, extra)

    def close(self) -> None:
        release(self.engine)
        if self._lora_dir is not None:
            self._lora_dir.cleanup()


class HfSession:
    """transformers at its best batch size: the first run tries the candidate sizes (each runs all
    requests, the fastest is kept and reported); later runs use that size."""

    def __init__(self, args: argparse.Namespace, ckpt: Checkpoint, tokenizer,
                 warmup: list[SampleRequest]) -> None:
        if args.hf_max_batch_size is not None and args.hf_max_batch_size < 1:
            raise ValueError(f"hf_max_batch_size must be at least 1, got {args.hf_max_batch_size}")
        self.args = args
        self.model = load_hf_model(ckpt)
        self.pad = hf_pad_token_id(tokenizer, self.model)
        hf_generate(self.model, [r.prompt_token_ids for r in warmup], warmup[0].expected_output_len,
                    self.pad)
        self.batch_size: int | None = None
        self.sweep: dict[int, float] = {}

    def run(self, requests: list[SampleRequest]) -> ThroughputResult:
        if self.batch_size is None:
            elapsed, num_output, self.batch_size = self._sweep(requests)
        else:
            elapsed, num_output = _hf_pass(self.model, requests, self.batch_size, self.pad)
        return ThroughputResult("hf", elapsed, len(requests), sum(r.prompt_len for r in requests),
                                num_output, {"hf_batch_size": self.batch_size,
                                             "hf_output_tokens_per_second_by_batch_size": self.sweep})

    def _sweep(self, requests: list[SampleRequest]) -> tuple[float, int, int]:
        """(elapsed, num_output, batch_size) of the fastest candidate batch size."""
        best = (0.0, 0, 0)
        for batch_size in _hf_batch_sizes(self.args.hf_max_batch_size, len(requests)):
            elapsed, num_output = _hf_pass(self.model, requests, batch_size, self.pad)
            self.sweep[batch_size] = num_output / elapsed
            print(f"[hf] batch size {batch_size}: {self.sweep[batch_size]:.2f} output tokens/s",
                  flush=True)
            if best[2] and self.sweep[batch_size] < self.sweep[best[2]]:
                break   # NOTE: throughput is unimodal in the batch size; smaller ones only get slower
            best = (elapsed, num_output, batch_size)
        return best

    def close(self) -> None:
        release(self.model)


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
    if args.rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {args.rounds}")
    start = start_benchmark(args)
    backends, tokenizer = start.backends, start.tokenizer
    other = _other_quantization(args)
    if other is not None:
        backends = ["minivllm", other]
    warmup = sample_random_requests(tokenizer, 2, 16, 4, seed=args.seed + 1)
    rounds = [get_requests(args, tokenizer, seed=args.seed + r) for r in range(args.rounds)]

    def open_session(backend: str):
        if backend == "minivllm":
            return MinivllmSession(args, warmup)
        if backend == other:
            return MinivllmSession(argparse.Namespace(
                **{**vars(args), "quantization": args.compare_quantization}), warmup)
        return HfSession(args, start.ckpt, tokenizer, warmup)

    runs: dict[str, list[ThroughputResult]] = {b: [] for b in backends}
    if args.rounds == 1:   # one backend loaded at a time
        for backend in backends:
            session = open_session(backend)
            try:
                runs[backend].append(session.run(rounds[0]))
            finally:
                session.close()
    else:
        _alternate_rounds(backends, rounds, open_session, runs)
    return _summarize(args, backends, runs, start.load_at_start)


def _other_quantization(args: argparse.Namespace) -> str | None:
    """The second minivllm backend's label with --compare-quantization (None without)."""
    method = getattr(args, "compare_quantization", None)
    if method is None:
        return None
    if args.compare:
        raise ValueError("--compare-quantization compares minivllm with itself; it cannot be "
                         "combined with --compare (transformers)")
    return f"minivllm -q {method}"


def _alternate_rounds(backends: list[str], rounds: list[list[SampleRequest]], open_session,
                      runs: dict[str, list[ThroughputResult]]) -> None:
    """Every backend loaded at once; each round runs all of them on its requests, the order
    reversed every other round (a drifting host favours neither)."""
    sessions = {}
    try:
        for backend in backends:
            sessions[backend] = open_session(backend)
        for i, requests in enumerate(rounds):
            for backend in (backends if i % 2 == 0 else backends[::-1]):
                runs[backend].append(sessions[backend].run(requests))
            line = ", ".join(f"{b} {runs[b][-1].output_throughput:.2f}" for b in backends)
            print(f"[round {i + 1}/{len(rounds)}] output tokens/s: {line}", flush=True)
    finally:
        for session in sessions.values():
            session.close()


def _summarize(args: argparse.Namespace, backends: list[str], runs: dict[str, list[ThroughputResult]],
               load_at_start: float) -> dict:
    """Per backend: all rounds pooled (tokens / time); with --compare the median per-round ratio."""
    results = {b: ThroughputResult.pooled(runs[b]).to_dict() for b in backends}

    def compare(results: dict) -> str:
        anchor = backends[1]   # transformers, or minivllm with the other quantization
        ratios = [m.output_throughput / h.output_throughput
                  for m, h in zip(runs["minivllm"], runs[anchor])]
        results["output_throughput_ratio"] = statistics.median(ratios)
        results["output_throughput_ratios"] = ratios
        rounds = (f", median of {len(ratios)} rounds: "
                  + " ".join(f"{r:.2f}x" for r in ratios)) if len(ratios) > 1 else ""
        label = (f"transformers (batch {results['hf']['hf_batch_size']})" if anchor == "hf"
                 else anchor)
        return (f"minivllm / {label}: {results['output_throughput_ratio']:.2f}x output "
                f"tokens/s{rounds}")

    return report(results, _print_result, compare, load_at_start, args.output_json)


def _print_result(r: dict, label: str) -> None:
    print(f"{label}Throughput: {r['requests_per_second']:.2f} requests/s, "
          f"{r['tokens_per_second']:.2f} total tokens/s, {r['output_tokens_per_second']:.2f} output tokens/s")
    print(f"{label}Total num prompt tokens:  {r['num_prompt_tokens']}")
    print(f"{label}Total num output tokens:  {r['num_output_tokens']}", flush=True)
