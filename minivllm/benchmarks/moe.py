"""`minivllm bench moe`: MoE decode and batch speed against transformers on the same weights.

A randomly initialised Qwen3-MoE checkpoint with a real MoE layer's shapes (default
Qwen3-30B-A3B's: hidden 2048, 128 experts of intermediate 768, top-8, 32 query / 4 KV heads of
128) but only a few layers and a smaller vocabulary, so that it fits in memory twice (written
once to a temporary folder, then loaded by both backends). Two measurements, each backend
warmed up first:
- batch-1 decode: (time of 1 + N new tokens - time of 1 new token) / N, one prompt;
- a batch of prompts (default 64) generated together: output tokens / wall time.
transformers runs its default experts implementation (recorded in the results), in the same
dtype and with the same torch threads.
Both backends are loaded together and measured in alternating rounds (the best round of each
counts), so load from other processes falls on both. Printed with the same-run ratios and the
decode floors the memory allows: the bytes of the parameters one token reads (attention, router,
top-k experts, norms, LM head) / the measured read bandwidth, and for the batch's decode steps
the bytes a step reads (the experts its tokens route to, uniform routing taken) / bandwidth.
"""

import argparse
import json
import os
import tempfile
import time

import torch

from minivllm.benchmarks.backends import check_cpu_load, hf_generate, release
from minivllm.benchmarks.roofline import measure_read_bandwidth

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def add_moe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    shape = parser.add_argument_group("model shape (defaults: Qwen3-30B-A3B's MoE layers)")
    for flag, default in (("num-layers", 2), ("hidden-size", 2048), ("num-experts", 128),
                          ("moe-intermediate-size", 768), ("top-k", 8), ("num-heads", 32),
                          ("num-kv-heads", 4), ("head-dim", 128), ("vocab-size", 32768)):
        shape.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--dtype", default="bfloat16", choices=list(_DTYPES))
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    parser.add_argument("--decode-tokens", type=int, default=32,
                        help="batch-1 decode: new tokens timed after the first")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32,
                        help="batch run: new tokens per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2,
                        help="measurement rounds, backends alternating; the best round counts")
    parser.add_argument("--skip-hf", action="store_true", help="minivllm only (no ratios)")
    parser.add_argument("--output-json", default=None, help="write the results to this JSON file")
    return parser


def moe_config(args: argparse.Namespace):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size, moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim,
        num_experts=args.num_experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.02,
        architectures=["Qwen3MoeForCausalLM"])


def write_checkpoint(args: argparse.Namespace, folder: str) -> None:
    """Random weights in `args.dtype`, saved with transformers (both backends read this file)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(moe_config(args), dtype=_DTYPES[args.dtype])
    model.save_pretrained(folder)
    release(model)


def active_bytes_per_token(args: argparse.Namespace) -> int:
    """Parameter bytes one decode token reads: per layer attention, norms, router and the top-k
    experts' gate/up/down; then the final norm and the LM head (the embedding is one row)."""
    return _bytes_per_step(args, args.top_k)


def experts_read_per_step(args: argparse.Namespace, batch: int) -> float:
    """Experts a decode step of `batch` sequences reads per layer, routing taken as uniform:
    each expert is missed by all of the step's tokens with probability (1 - k / E)^batch."""
    e, k = args.num_experts, args.top_k
    return e * (1.0 - (1.0 - k / e) ** batch)


def _bytes_per_step(args: argparse.Namespace, experts_read: float) -> int:
    """Parameter bytes of one decode step that reads `experts_read` experts per layer."""
    h, d = args.hidden_size, args.head_dim
    attn = h * d * (2 * args.num_heads + 2 * args.num_kv_heads) + 2 * d + 2 * h
    experts = experts_read * 3 * args.moe_intermediate_size * h + args.num_experts * h
    params = args.num_layers * (attn + experts) + h + args.vocab_size * h
    return int(params) * _DTYPES[args.dtype].itemsize


def _prompts(args: argparse.Namespace, count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, args.vocab_size, (count, args.input_len), generator=gen).tolist()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def minivllm_generator(args: argparse.Namespace, path: str):
    """(generate(prompts, n), the engine) for minivllm on the checkpoint."""
    from minivllm import LLM, SamplingParams

    llm = LLM(model=path, dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=args.input_len + max(args.decode_tokens, args.output_len) + 8,
              max_num_seqs=max(args.num_prompts, 1), kv_cache_memory_bytes=1 << 29)

    def gen(prompts: list[list[int]], n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        llm.generate(prompts, params, use_tqdm=False)

    return gen, llm


def hf_generator(args: argparse.Namespace, path: str):
    """(generate(prompts, n), the model) for transformers' eager model on the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[args.dtype]).eval()
    return (lambda prompts, n: hf_generate(model, prompts, n, 0)), model


def _decode_s(args: argparse.Namespace, gen) -> float:
    """Batch-1 decode seconds per token: (1 + N new tokens - 1 new token) / N."""
    one = _prompts(args, 1, seed=2)
    first = _timed(lambda: gen(one, 1))
    total = _timed(lambda: gen(one, 1 + args.decode_tokens))
    return max(total - first, 1e-9) / args.decode_tokens


def _measure(args: argparse.Namespace, gens: dict) -> dict:
    """Warm-up, then `--rounds` rounds in which every backend runs batch-1 decode and then the
    batch of prompts, backends alternating inside each round (a busy box then slows both alike);
    each figure is its backend's best round."""
    for gen in gens.values():
        gen(_prompts(args, 2, seed=1), 4)
    decode = {name: [] for name in gens}
    batch = {name: [] for name in gens}
    prompts = _prompts(args, args.num_prompts, seed=3)
    for _ in range(args.rounds):
        for name, gen in gens.items():
            decode[name].append(_decode_s(args, gen))
        for name, gen in gens.items():
            batch[name].append(_timed(lambda: gen(prompts, args.output_len)))
    return {name: {"decode_ms_per_token": min(decode[name]) * 1e3,
                   "decode_tokens_per_s": 1.0 / min(decode[name]),
                   "batch_output_tokens_per_s": args.num_prompts * args.output_len
                   / min(batch[name]),
                   "batch_seconds": min(batch[name]),
                   "decode_ms_per_round": [d * 1e3 for d in decode[name]],
                   "batch_seconds_per_round": batch[name]} for name in gens}


def run_moe(args: argparse.Namespace) -> dict:
    load_at_start = os.getloadavg()[0]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="minivllm-bench-moe-") as folder:
        write_checkpoint(args, folder)
        # Both loaded at once (the checkpoint fits twice), so their rounds can alternate.
        gen, llm = minivllm_generator(args, folder)
        gens, owners = {"minivllm": gen}, [llm]
        if not args.skip_hf:
            gens["hf"], model = hf_generator(args, folder)
            owners.append(model)
        try:
            results.update(_measure(args, gens))
        finally:
            for owner in owners:
                release(owner)
        if not args.skip_hf:
            results["hf"]["experts_implementation"] = getattr(
                model.config, "_experts_implementation", None)
            del model
    bandwidth = measure_read_bandwidth()
    floor_s = active_bytes_per_token(args) / bandwidth
    experts_read = experts_read_per_step(args, args.num_prompts)
    step_bytes = _bytes_per_step(args, experts_read)
    results["floor"] = {"active_bytes_per_token": active_bytes_per_token(args),
                        "read_bandwidth_gb_per_s": bandwidth / 1e9,
                        "decode_floor_ms_per_token": floor_s * 1e3,
                        "max_decode_tokens_per_s": 1.0 / floor_s,
                        # the batch's decode steps: every sequence one token, all sharing the
                        # experts' weights they route to
                        "batch_experts_read_per_layer": experts_read,
                        "batch_bytes_per_step": step_bytes,
                        "max_batch_decode_tokens_per_s": args.num_prompts * bandwidth
                        / step_bytes}
    _print(results)
    results["host"] = check_cpu_load(load_at_start)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=4)
    return results


def _print(results: dict) -> None:
    for backend in ("minivllm", "hf"):
        if backend in results:
            r = results[backend]
            print(f"[{backend}] batch-1 decode: {r['decode_tokens_per_s']:.2f} tok/s "
                  f"({r['decode_ms_per_token']:.1f} ms/token); batch: "
                  f"{r['batch_output_tokens_per_s']:.1f} output tok/s")
    if "hf" in results:
        ours, hf = results["minivllm"], results["hf"]
        results["ratios"] = {
            "decode": ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"],
            "batch": ours["batch_output_tokens_per_s"] / hf["batch_output_tokens_per_s"]}
        print(f"minivllm / transformers (same run): batch-1 decode "
              f"{results['ratios']['decode']:.2f}x, batch {results['ratios']['batch']:.2f}x "
              f"(transformers experts: {hf.get('experts_implementation')})")
    f = results["floor"]
    print(f"bandwidth floor: {f['active_bytes_per_token'] / 1e6:.1f} MB of active parameters "
          f"per token / {f['read_bandwidth_gb_per_s']:.1f} GB/s = "
          f"{f['decode_floor_ms_per_token']:.1f} ms/token "
          f"(at most {f['max_decode_tokens_per_s']:.1f} tok/s at batch 1); the batch's decode "
          f"steps read ~{f['batch_experts_read_per_layer']:.0f} experts per layer "
          f"({f['batch_bytes_per_step'] / 1e6:.0f} MB a step): at most "
          f"{f['max_batch_decode_tokens_per_s']:.0f} tok/s")
