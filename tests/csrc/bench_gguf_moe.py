"""Micro-benchmark (not a test): one MoE layer's experts packed in GGUF blocks against bf16.

Run: PYTHONPATH=. python tests/csrc/bench_gguf_moe.py [TYPE] [T ...]   (default Q4_1; 1 4 16 64 256)
TYPE: a legacy type gguf-py can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); K-quant MoE files are
measured end to end by `minivllm bench moe --gguf-type Q4_K_M`.
One Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts of intermediate 768, top-8), random weights
quantized by gguf-py: milliseconds per call of `fused_experts_gguf` (the packed experts) and of
`fused_experts_bf16` on the same weights dequantised, for T tokens with random routing. The two
calls alternate inside each of 5 rounds (the 2-core host is shared); medians reported.
"""

import statistics
import sys
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T, quants

from minivllm.model_executor.kernels.gguf_linear import gguf_dequantize, gguf_repack_for_cpu
from minivllm.model_executor.layers.fused_moe.cpu_fused_moe import (fused_experts_bf16,
                                                                    fused_experts_gguf)
from minivllm.model_executor.layers.fused_moe.fused_moe import fused_topk

E, H, I, K = 128, 2048, 768, 8


def _stack(qtype: int, rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    return torch.from_numpy(np.stack([
        quants.quantize((rng.standard_normal((rows, cols)) * 0.02).astype(np.float32), qtype)
        for _ in range(E)]))


def _median_ms(fns: dict, rounds: int = 5, calls: int = 5) -> dict:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    qtype = T[sys.argv[1]] if len(sys.argv) > 1 else T.Q4_1
    if qtype not in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        sys.exit(f"{qtype.name}: gguf-py quantizes only Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0")
    counts = [int(a) for a in sys.argv[2:]] or [1, 4, 16, 64, 256]
    rng = np.random.default_rng(0)
    w13, w2 = _stack(qtype, 2 * I, H, rng), _stack(qtype, H, I, rng)
    b13 = torch.stack([gguf_dequantize(w, int(qtype), torch.bfloat16) for w in w13])
    b2 = torch.stack([gguf_dequantize(w, int(qtype), torch.bfloat16) for w in w2])
    # the layout the loader gives the experts on this CPU (x8 where its kernels are built)
    c13 = gguf_repack_for_cpu(w13.view(-1, w13.shape[2]), int(qtype))
    c2 = gguf_repack_for_cpu(w2.view(-1, w2.shape[2]), int(qtype))
    print(f"{qtype.name} experts (kernel codes {c13}, {c2}): "
          f"{(w13.numel() + w2.numel()) / 1e6:.0f} MB packed, "
          f"{(b13.numel() + b2.numel()) * 2 / 1e6:.0f} MB bf16")
    for count in counts:
        gen = torch.Generator().manual_seed(count)
        x = torch.randn(count, H, generator=gen).bfloat16()
        weights, ids, _ = fused_topk(x, torch.randn(count, E, generator=gen), K, True)
        fns = {"gguf": lambda: fused_experts_gguf(x, w13, c13, w2, c2, weights, ids),
               "bf16": lambda: fused_experts_bf16(x, b13, b2, weights, ids)}
        if fns["bf16"]() is None:       # refused at this size here: the torch loop runs it
            del fns["bf16"]
        ms = _median_ms(fns)
        bf16 = (f"bf16 {ms['bf16']:7.2f} ms  bf16 / packed {ms['bf16'] / ms['gguf']:.2f}"
                if "bf16" in ms else "bf16: native kernel refuses (torch loop)")
        print(f"T={count:4d}: packed {ms['gguf']:7.2f} ms  {bf16}")

if __name__ == "__main__":
    main()
