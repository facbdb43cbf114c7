"""Micro-benchmark (not a test): GGUF linears on the default model's shapes, against bf16.

Run: PYTHONPATH=. [THREADS=2] [LAYERS=30] python tests/csrc/bench_gguf_gemm.py [M ...]
(THREADS=1: CPU time. LAYERS=n: each call takes the next of n copies of the weight, so weights come
from memory as in a model step instead of staying in L2, which flatters the bf16 path: 2-4x the
bytes of the packed weight.)
For each shape (SmolLM2-135M: qkv, o, gate_up, down in Q4_1, the tied LM head in Q8_0) and row
count M: microseconds per `gguf_linear` call, the packed weight's bytes per second, and the same
run's bf16 path on the dequantised weight (M <= 64: the native AMX GEMM / GEMV; more rows:
oneDNN via F.linear) and dequantise-all + F.linear. A/B calls interleave, medians reported
(the 2-core host is shared). The last line sums one decode step's linears (30 layers + head).
"""

import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T, quants

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels.gguf_linear import gguf_dequantize, gguf_linear

SHAPES = [("qkv", 960, 576, T.Q4_1), ("o", 576, 576, T.Q4_1), ("gate_up", 3072, 576, T.Q4_1),
          ("down", 576, 1536, T.Q4_1), ("lm_head", 49152, 576, T.Q8_0)]
PER_STEP = {"qkv": 30, "o": 30, "gate_up": 30, "down": 30, "lm_head": 1}


def interleaved(fns: dict, reps: int) -> dict[str, float]:
    """Median us per call of each fn, calls interleaved round-robin. With one thread the clock is
    the thread's CPU time (which other processes on the shared host barely disturb), else wall
    time."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append((clock() - t0) * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}


def bf16_path(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.shape[0] <= 64 and ops.gemm_supports_weight(w):
        return ops.gemm_bf16(x, w, None)
    if ops.gemv_supported(x, w):
        return ops.gemv_bf16(x, w, None)
    return F.linear(x, w)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    ms = [int(a) for a in sys.argv[1:]] or [1, 16, 64, 256]
    layers = int(os.environ.get("LAYERS", "1"))
    rng = np.random.default_rng(0)
    assert ops.native_available()
    for m in ms:
        step = {"gguf": 0.0, "bf16": 0.0}
        print(f"M={m}: us/call (gguf | bf16 native | dequant-all+F.linear), GB/s of packed "
              f"weight, bf16/gguf time ratio")
        for name, n, k, qtype in SHAPES:
            qw = torch.from_numpy(quants.quantize(
                rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype))
            w = gguf_dequantize(qw, qtype, torch.bfloat16)
            copies = layers if name != "lm_head" else 1
            qws, ws = [qw.clone() for _ in range(copies)], [w.clone() for _ in range(copies)]
            turn = iter(range(10 ** 9))
            x = torch.randn(m, k).bfloat16()
            fns = {"gguf": lambda: gguf_linear(x, qws[next(turn) % copies], qtype, None),
                   "bf16": lambda: bf16_path(x, ws[next(turn) % copies])}
            if m > 1:
                fns["deq"] = lambda: F.linear(x, gguf_dequantize(qw, qtype, torch.bfloat16))
            reps = max(15, min(400, int(2e5 / (n * k / 1e3) / max(1, m / 16))))
            t = interleaved(fns, reps)
            gbs = qw.numel() / t["gguf"] / 1e3
            deq = f" | {t['deq']:9.1f}" if "deq" in t else ""
            print(f"  {name:8s} [{n:5d},{k:4d}] {T(qtype).name}: {t['gguf']:8.1f} | "
                  f"{t['bf16']:8.1f}{deq}  {gbs:5.1f} GB/s  x{t['bf16'] / t['gguf']:.2f}")
            step["gguf"] += PER_STEP[name] * t["gguf"]
            step["bf16"] += PER_STEP[name] * t["bf16"]
        print(f"  one step's linears: gguf {step['gguf'] / 1e3:.2f} ms, bf16 "
              f"{step['bf16'] / 1e3:.2f} ms (x{step['bf16'] / step['gguf']:.2f})")


if __name__ == "__main__":
    main()
