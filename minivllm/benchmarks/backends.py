"""What the benchmarks run on: a minivllm `LLMEngine`, or the same checkpoint in transformers (`generate`)."""

import argparse
import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.config import ModelConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.transformers_utils.tokenizer import get_tokenizer

BACKENDS = ("minivllm", "hf")


@dataclass
class Checkpoint:
    """The checkpoint and dtype both backends load (resolved as minivllm resolves them)."""

    model: str
    tokenizer: str
    dtype: torch.dtype


@dataclass
class BenchStart:
    """What every benchmark begins with (`start_benchmark`)."""

    load_at_start: float   # the host's load before anything of ours runs
    backends: list[str]
    ckpt: Checkpoint
    tokenizer: Any


def start_benchmark(args: argparse.Namespace) -> BenchStart:
    """The host load, the backends to run, the checkpoint and its tokenizer."""
    load_at_start = os.getloadavg()[0]
    backends = backends_to_run(args)
    ckpt = resolve_checkpoint(args)
    return BenchStart(load_at_start, backends, ckpt, load_tokenizer(ckpt))


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    """Backend choice, JSON output, profiling, and every engine flag (`--model`, `--dtype`, ...)."""
    parser.add_argument("--backend", default="minivllm", choices=BACKENDS)
    parser.add_argument("--compare", action="store_true",
                        help="run minivllm and transformers in this process and print the ratio")
    parser.add_argument("--output-json", default=None, help="write the results to this JSON file")
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="minivllm: skip detokenizing the outputs")
    parser.add_argument("--profile", action="store_true",
                        help="minivllm: run under torch.profiler and print the top ops")
    parser.add_argument("--profile-result-dir", default=None,
                        help="with --profile: also write a Chrome trace here")
    EngineArgs.add_cli_args(parser)


def backends_to_run(args: argparse.Namespace) -> list[str]:
    if args.backend not in BACKENDS:
        raise ValueError(f"Unknown backend {args.backend!r}; choose one of {', '.join(BACKENDS)}")
    return list(BACKENDS) if args.compare else [args.backend]


def resolve_checkpoint(args: argparse.Namespace) -> Checkpoint:
    """Model path, tokenizer path and torch dtype exactly as minivllm's ModelConfig resolves them."""
    cfg = ModelConfig(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype,
                      max_model_len=getattr(args, "max_model_len", None))
    return Checkpoint(cfg.model, cfg.tokenizer, cfg.dtype)


def load_tokenizer(ckpt: Checkpoint):
    return get_tokenizer(ckpt.tokenizer)


def make_engine(args: argparse.Namespace) -> LLMEngine:
    """A minivllm engine built from the engine flags (as the offline LLM builds its own)."""
    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))


def load_hf_model(ckpt: Checkpoint) -> torch.nn.Module:
    """The same checkpoint in transformers, as dense weights in the same dtype as minivllm."""
    from transformers import AutoModelForCausalLM

    if ckpt.model.endswith(".gguf"):
        from transformers import GgufConfig

        # NOTE: dequantize=True keeps the comparison dense-vs-dense: transformers would otherwise
        # run packed-GGUF kernels when the `kernels` package is installed.
        path = os.path.abspath(ckpt.model)
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=ckpt.dtype,
            quantization_config=GgufConfig(dequantize=True))
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt.model, dtype=ckpt.dtype)
    return model.eval()


def hf_pad_token_id(tokenizer, model: torch.nn.Module) -> int:
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                      model.generation_config.pad_token_id, model.generation_config.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `input_ids` and `attention_mask`, both [batch, max_prompt_len]."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], output_len: int, pad_token_id: int,
                streamer=None) -> torch.Tensor:
    """Greedy `generate` of exactly `output_len` new tokens per prompt; returns [batch, output_len]."""
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             min_new_tokens=output_len, max_new_tokens=output_len,
                             pad_token_id=pad_token_id, use_cache=True, streamer=streamer)
    return out[:, input_ids.shape[1]:]


def release(obj) -> None:
    """Drop a model/engine before loading the next backend (its memory and threads go back)."""
    shutdown = getattr(obj, "shutdown", None)
    if shutdown is not None:
        shutdown()
    del obj
    gc.collect()


def check_cpu_load(load_at_start: float) -> dict:
    """Warns when other processes load the CPU. torch's threads then wait for a scheduler tick at
    every parallel op (measured here: a [1, 64] x [64, 256] linear took 8 ms instead of 7 us with 2
    threads while another process kept one core busy)."""
    load, num_cpus = os.getloadavg()[0], os.cpu_count() or 1
    # At the start nothing of ours runs yet; at the end the load includes our own threads.
    if load_at_start > 1.0 or load > torch.get_num_threads() + 1.0:
        print(f"WARNING: load average {load_at_start:.1f} before / {load:.1f} after the run on "
              f"{num_cpus} CPUs: other processes compete for the cores, so these figures are "
              "unreliable (ratios measured in one run less so).", flush=True)
    return {"load_average_1m_start": load_at_start, "load_average_1m_end": load, "num_cpus": num_cpus,
            "torch_num_threads": torch.get_num_threads()}


@contextlib.contextmanager
def maybe_profile(args: argparse.Namespace, label: str, enabled: bool = True) -> Iterator[None]:
    """With --profile, wrap the timed region in torch.profiler and print the top ops after it."""
    if not (enabled and getattr(args, "profile", False)):
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield
    print(f"\n== torch.profiler: {label} (top ops by self CPU time) ==")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    if args.profile_result_dir:
        os.makedirs(args.profile_result_dir, exist_ok=True)
        trace = os.path.join(args.profile_result_dir, f"{label}-{int(time.time())}.json")
        prof.export_chrome_trace(trace)
        print(f"Chrome trace: {trace}")


def report(results: dict[str, dict], print_result: Callable[[dict, str], None],
           compare: Callable[[dict], str], load_at_start: float, output_json: str | None,
           always_label: bool = False) -> dict:
    """The tail every benchmark shares: print each backend's result (labelled `[backend] ` when
    there are several, or `always_label`), with several backends the comparison line `compare`
    returns (it may add ratios to `results`), then `write_summary`."""
    backends = list(results)
    for backend in backends:
        print_result(results[backend], f"[{backend}] " if always_label or len(backends) > 1 else "")
    if len(backends) > 1:
        print(compare(results))
    return write_summary(results, backends, load_at_start, output_json)


def write_summary(results: dict, backends: list[str], load_at_start: float,
                  output_json: str | None) -> dict:
    """The per-backend results (or the one backend's), the host load, optionally saved as JSON."""
    import json

    summary = results if len(backends) > 1 else results[backends[0]]
    summary["host"] = check_cpu_load(load_at_start)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(summary, f, indent=4)
    return summary
