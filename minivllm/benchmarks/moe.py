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
floors the machine allows (`moe_floors`: bandwidth, compute and roofline).
"""

import argparse
import json
import os
import tempfile
import time

import torch

from minivllm.benchmarks.backends import check_cpu_load, hf_generate, release
from minivllm.benchmarks.gguf_variants import VARIANT_TYPES
from minivllm.benchmarks.moe_gguf import load_state, write_moe_gguf
from minivllm.benchmarks.moe_floors import floors, print_floors

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
    parser.add_argument("--gguf-type", default=None, choices=list(VARIANT_TYPES),
                        help="also run minivllm on the same weights written as a GGUF file with "
                             "every matrix (experts included) in this type, kept packed")
    parser.add_argument("--compare", default=None, choices=["llama.cpp"],
                        help="with --gguf-type: batch-1 decode of llama.cpp on that file too")
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
    batch of prompts (llama.cpp: decode only, it runs one sequence), backends alternating inside
    each round (a busy box then slows both alike); each figure is its backend's best round."""
    batched = [name for name in gens if name != "llama.cpp"]
    for name, gen in gens.items():
        gen(_prompts(args, 2 if name in batched else 1, seed=1), 4)
    decode = {name: [] for name in gens}
    batch = {name: [] for name in batched}
    prompts = _prompts(args, args.num_prompts, seed=3)
    for _ in range(args.rounds):
        for name, gen in gens.items():
            decode[name].append(_decode_s(args, gen))
        for name in batched:
            batch[name].append(_timed(lambda: gens[name](prompts, args.output_len)))
    results = {name: {"decode_ms_per_token": min(decode[name]) * 1e3,
                      "decode_tokens_per_s": 1.0 / min(decode[name]),
                      "decode_ms_per_round": [d * 1e3 for d in decode[name]]} for name in gens}
    for name in batched:
        results[name] |= {"batch_output_tokens_per_s": args.num_prompts * args.output_len
                          / min(batch[name]),
                          "batch_seconds": min(batch[name]),
                          "batch_seconds_per_round": batch[name]}
    return results


def run_moe(args: argparse.Namespace) -> dict:
    if args.compare and not args.gguf_type:
        raise ValueError("--compare llama.cpp needs --gguf-type (llama.cpp reads the GGUF file)")
    load_at_start = os.getloadavg()[0]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="minivllm-bench-moe-") as folder:
        write_checkpoint(args, folder)
        gguf_path = (os.path.join(folder, f"moe.{args.gguf_type}.gguf") if args.gguf_type
                     else None)
        # All loaded at once (the checkpoint fits twice), so their rounds can alternate.
        gens, owners = _generators(args, folder, gguf_path)
        try:
            results.update(_measure(args, gens))
        finally:
            for owner in owners:
                release(owner)
        if "hf" in gens:
            results["hf"]["experts_implementation"] = getattr(
                owners[-1].config, "_experts_implementation", None)
        del owners
        results["floor"] = floors(args, gguf_path)
    _print(results)
    results["host"] = check_cpu_load(load_at_start)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=4)
    return results


def _generators(args: argparse.Namespace, folder: str,
                gguf_path: str | None) -> tuple[dict, list]:
    """({backend: generate(prompts, n)}, the objects to release; transformers' model last)."""
    gens, owners = {}, []
    gen, llm = minivllm_generator(args, folder)
    gens["minivllm"] = gen
    owners.append(llm)
    if gguf_path is not None:
        path = write_moe_gguf(moe_config(args), load_state(folder), gguf_path, args.gguf_type)
        gens["minivllm-gguf"], llm = minivllm_generator(args, path)
        owners.append(llm)
        if args.compare == "llama.cpp":
            gens["llama.cpp"], model = llama_cpp_generator(args, path)
            owners.append(model)
    if not args.skip_hf:
        gens["hf"], model = hf_generator(args, folder)
        owners.append(model)
    return gens, owners


def llama_cpp_generator(args: argparse.Namespace, path: str):
    """(generate(one prompt, n), the model) for llama.cpp on the GGUF file (batch-1 only)."""
    from minivllm.benchmarks.llama_cpp import LlamaCppModel, time_llama_cpp

    model = LlamaCppModel(path, n_ctx=args.input_len + args.decode_tokens + 8,
                          n_threads=torch.get_num_threads())

    def gen(prompts: list[list[int]], n: int) -> None:
        assert len(prompts) == 1, "llama.cpp runs one sequence here"
        time_llama_cpp(model, prompts[0], n)

    return gen, model


def _print(results: dict) -> None:
    for backend in ("minivllm", "minivllm-gguf", "llama.cpp", "hf"):
        if backend in results:
            r = results[backend]
            batch = (f"; batch: {r['batch_output_tokens_per_s']:.1f} output tok/s"
                     if "batch_output_tokens_per_s" in r else "")
            print(f"[{backend}] batch-1 decode: {r['decode_tokens_per_s']:.2f} tok/s "
                  f"({r['decode_ms_per_token']:.1f} ms/token){batch}")
    results["ratios"] = ratios = {}
    for ours, theirs, label in (("minivllm", "hf", "minivllm / transformers"),
                                ("minivllm-gguf", "hf", "minivllm GGUF / transformers"),
                                ("minivllm-gguf", "minivllm", "minivllm GGUF / minivllm bf16"),
                                ("minivllm-gguf", "llama.cpp", "minivllm GGUF / llama.cpp")):
        if ours not in results or theirs not in results:
            continue
        a, b = results[ours], results[theirs]
        key = "decode" if theirs == "hf" and ours == "minivllm" else f"{ours}/{theirs}"
        pair = {"decode": a["decode_tokens_per_s"] / b["decode_tokens_per_s"]}
        if "batch_output_tokens_per_s" in b:
            pair["batch"] = a["batch_output_tokens_per_s"] / b["batch_output_tokens_per_s"]
        if key == "decode":          # the plain pair keeps its flat keys
            ratios |= pair
        else:
            ratios[key] = pair
        batch = f", batch {pair['batch']:.2f}x" if "batch" in pair else ""
        extra = (f" (transformers experts: {b.get('experts_implementation')})"
                 if theirs == "hf" else "")
        print(f"{label} (same run): batch-1 decode {pair['decode']:.2f}x{batch}{extra}")
    print_floors(results["floor"])
