"""The floors `bench moe` prints beside its figures: what the memory and the arithmetic of this
machine allow for the MoE model's batch-1 decode and its batch of prompts.

- bandwidth floors: the bytes of the parameters one decode token reads (attention, router, top-k
  experts, norms, LM head) / the measured read bandwidth, and for the batch's decode steps the
  bytes a step reads (the experts its tokens route to, uniform routing taken) / bandwidth;
- the compute floor: the batch's multiply-adds / the rate of a large GEMM in --dtype here (with
  --gguf-type: of the faster of that and the packed kernel);
- the roofline floor of the batch: its prompt step and each decode step at the larger of their
  compute time and their weight-read time, summed (the bound neither floor alone gives).
"""

import argparse

import torch

from minivllm.benchmarks.roofline import (measure_gemm_rate, measure_gguf_gemm_rate,
                                          measure_read_bandwidth)


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
    """Parameter bytes (in --dtype) of one step that reads `experts_read` experts per layer."""
    h, d = args.hidden_size, args.head_dim
    attn = h * d * (2 * args.num_heads + 2 * args.num_kv_heads) + 2 * d + 2 * h
    experts = experts_read * 3 * args.moe_intermediate_size * h + args.num_experts * h
    params = args.num_layers * (attn + experts) + h + args.vocab_size * h
    return int(params * getattr(torch, args.dtype).itemsize)


def _forward_macs(args: argparse.Namespace, p0: int, p1: int, sampled: int) -> int:
    """Multiply-adds of one sequence's forward positions [p0, p1) through the layers'
    projections, router, top-k experts and attention, plus `sampled` rows of the LM head."""
    h, d, heads = args.hidden_size, args.head_dim, args.num_heads
    per_token = (h * d * (2 * heads + 2 * args.num_kv_heads) + h * args.num_experts
                 + args.top_k * 3 * args.moe_intermediate_size * h)
    # QK^T and PV at position p (0-based) read p + 1 keys: 2 * heads * d * (p + 1)
    keys = (p1 * (p1 + 1) - p0 * (p0 + 1)) // 2
    return args.num_layers * ((p1 - p0) * per_token + 2 * heads * d * keys) \
        + sampled * args.vocab_size * h


def _step_macs(args: argparse.Namespace) -> list[int]:
    """The batch run's steps: the prompts' (their first token sampled), then each decode step
    (one position per sequence, fed the last token; the final token is never fed back)."""
    n, p = args.num_prompts, args.input_len
    return [n * _forward_macs(args, 0, p, 1)] + [
        n * _forward_macs(args, p + j, p + j + 1, 1) for j in range(args.output_len - 1)]


def batch_macs(args: argparse.Namespace) -> int:
    """Multiply-adds of the batch run: every prompt's forward positions (its prompt, then each
    generated token but the last) and the LM head at the sampled positions."""
    return sum(_step_macs(args))


def gguf_step_bytes(path: str, num_experts: int,
                    experts_read: tuple[float, ...]) -> tuple[int, ...]:
    """For each count in `experts_read`: bytes of the GGUF file's tensors one decode step reads
    with that many experts per layer (everything but the embedding, which is one row; the
    expert stacks `ffn_*_exps` in the share count / num_experts). The file is read once."""
    from gguf import GGUFReader

    dense = experts = 0
    for tensor in GGUFReader(path).tensors:
        if tensor.name == "token_embd.weight":
            continue
        if "_exps." in tensor.name:
            experts += int(tensor.n_bytes)
        else:
            dense += int(tensor.n_bytes)
    return tuple(int(dense + experts * n / num_experts) for n in experts_read)


def floors(args: argparse.Namespace, gguf_path: str | None) -> dict:
    """The bandwidth, compute and roofline floors, for the --dtype weights and (with
    --gguf-type) the GGUF file's packed tensors."""
    bandwidth = measure_read_bandwidth()
    experts_read = experts_read_per_step(args, args.num_prompts)
    e = args.num_experts
    # (bytes a token reads, a batch decode step reads, the prompt step reads: every expert)
    sizes = {"": (active_bytes_per_token(args), _bytes_per_step(args, experts_read),
                  _bytes_per_step(args, e))}
    if gguf_path is not None:
        sizes["gguf_"] = gguf_step_bytes(gguf_path, e, (args.top_k, experts_read, e))
    out = {"read_bandwidth_gb_per_s": bandwidth / 1e9,
           "batch_experts_read_per_layer": experts_read}
    for name, (per_token, step_bytes, _) in sizes.items():
        out |= {f"{name}active_bytes_per_token": per_token,
                f"{name}decode_floor_ms_per_token": per_token / bandwidth * 1e3,
                f"{name}max_decode_tokens_per_s": bandwidth / per_token,
                # the batch's decode steps: every sequence one token, all sharing the experts'
                # weights they route to
                f"{name}batch_bytes_per_step": step_bytes,
                f"{name}max_batch_decode_tokens_per_s": args.num_prompts * bandwidth
                / step_bytes}
    return out | _compute_floors(args, sizes, bandwidth)


def _compute_floors(args: argparse.Namespace, sizes: dict, bandwidth: float) -> dict:
    """Compute floor (the batch's multiply-adds / the GEMM rate) and roofline floor (each step
    at the larger of its multiply-adds / rate and its weight bytes / bandwidth), with the
    output tok/s each allows; the packed weights' rate is the faster of the GEMM and the
    packed kernel."""
    steps = _step_macs(args)
    macs, tokens = sum(steps), args.num_prompts * args.output_len
    rates = {"": measure_gemm_rate(getattr(torch, args.dtype))}
    out = {"batch_macs": macs, "gemm_dtype": args.dtype, "gemm_rate_gmac_per_s": rates[""] / 1e9}
    if "gguf_" in sizes:
        packed = measure_gguf_gemm_rate(args.gguf_type)
        out["gguf_gemm_rate_gmac_per_s"] = packed / 1e9
        rates["gguf_"] = max(packed, rates[""])
    for name, rate in rates.items():
        _, step_bytes, prompt_bytes = sizes[name]
        roofline = max(steps[0] / rate, prompt_bytes / bandwidth) + sum(
            max(m / rate, step_bytes / bandwidth) for m in steps[1:])
        out |= {f"{name}compute_floor_batch_seconds": macs / rate,
                f"{name}max_batch_tokens_per_s_compute": tokens * rate / macs,
                f"{name}roofline_batch_seconds": roofline,
                f"{name}max_batch_tokens_per_s_roofline": tokens / roofline}
    return out


def print_floors(f: dict) -> None:
    for name, label in (("", "bandwidth floor"), ("gguf_", "GGUF bandwidth floor")):
        if f"{name}active_bytes_per_token" not in f:
            continue
        print(f"{label}: {f[name + 'active_bytes_per_token'] / 1e6:.1f} MB of active parameters "
              f"per token / {f['read_bandwidth_gb_per_s']:.1f} GB/s = "
              f"{f[name + 'decode_floor_ms_per_token']:.1f} ms/token (at most "
              f"{f[name + 'max_decode_tokens_per_s']:.1f} tok/s at batch 1); the batch's decode "
              f"steps read ~{f['batch_experts_read_per_layer']:.0f} experts per layer "
              f"({f[name + 'batch_bytes_per_step'] / 1e6:.0f} MB a step): at most "
              f"{f[name + 'max_batch_decode_tokens_per_s']:.0f} tok/s")
    gmac = f["batch_macs"] / 1e9
    print(f"compute floor: {gmac:.0f} GMAC for the batch (prompts, decode steps, LM head at the "
          f"sampled positions) / {f['gemm_rate_gmac_per_s']:.0f} GMAC/s (a [1024, 2048] x "
          f"[4096, 2048]^T {f['gemm_dtype']} F.linear here) = "
          f"{f['compute_floor_batch_seconds']:.2f} s: at most "
          f"{f['max_batch_tokens_per_s_compute']:.0f} tok/s; roofline (each step at the larger "
          f"of its compute and weight-read times): {f['roofline_batch_seconds']:.2f} s, at most "
          f"{f['max_batch_tokens_per_s_roofline']:.0f} tok/s")
    if "gguf_compute_floor_batch_seconds" in f:
        print(f"GGUF compute floor: {gmac:.0f} GMAC / the faster of that and the packed kernel "
              f"(64 rows x a [4096, 2048] weight: {f['gguf_gemm_rate_gmac_per_s']:.0f} GMAC/s) "
              f"= {f['gguf_compute_floor_batch_seconds']:.2f} s: at most "
              f"{f['gguf_max_batch_tokens_per_s_compute']:.0f} tok/s; roofline: "
              f"{f['gguf_roofline_batch_seconds']:.2f} s, at most "
              f"{f['gguf_max_batch_tokens_per_s_roofline']:.0f} tok/s")
