"""Micro-benchmark (not a test): per-layer time of Attention on the CPU paged backend.

Run: PYTHONPATH=. [THREADS=1] python tests/model_executor/layers/attention/bench_cpu_attn.py
SmolLM2-135M geometry (nH=9, nKV=3, d=64), block size 16. "hf-like" is what a contiguous
DynamicCache + SDPA costs per layer (torch.cat of the cache, padded mask) for comparison.
"""

import os
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from minivllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from minivllm.distributed import ensure_model_parallel_initialized
from minivllm.forward_context import set_forward_context
from minivllm.model_executor.layers.attention import Attention
from minivllm.model_executor.layers.attention.backends import (CommonAttentionMetadata,
                                                               TorchAttentionMetadataBuilder)

NH, NKV, D, BS = 9, 3, 64, 16


def timeit(fn, reps: int = 30, inner: int = 5) -> float:
    """Min over `reps` of the mean over `inner` calls, in ms.

    With one thread this is the thread's CPU time, which other processes on a shared host barely
    disturb; with more threads it is wall time (and only meaningful on an idle host).
    """
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        for _ in range(inner):
            fn()
        times.append((clock() - t0) / inner * 1e3)
    return min(times)


def run_case(q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, cfg: VllmConfig,
             layer: Attention, shuffle: bool = True) -> tuple[float, float, float | None]:
    """(layer ms, builder ms, hf-like ms or None) for one batch; blocks shuffled unless asked."""
    b = len(seq_lens)
    blocks = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(blocks) + 8
    perm = torch.randperm(num_blocks) if shuffle else torch.arange(num_blocks)
    table = torch.zeros(b, max(blocks), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    seq, ql = torch.tensor(seq_lens), torch.tensor(q_lens)
    pos = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])  # [T]
    sid = torch.repeat_interleave(torch.arange(b), ql)
    slots = table[sid, pos // BS].long() * BS + pos % BS
    qsl = torch.zeros(b + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(ql, 0)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=seq.int(), block_table=table, slot_mapping=slots,
        num_actual_tokens=int(ql.sum()), max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    builder = TorchAttentionMetadataBuilder(BS)
    layer.bind_kv_cache(torch.randn(layer.get_kv_cache_shape(num_blocks, BS), dtype=dtype))
    qkv = torch.randn(len(pos), (NH + 2 * NKV) * D, dtype=dtype)
    q, k, v = qkv.split([NH * D, NKV * D, NKV * D], dim=-1)
    md = builder.build(common)
    with set_forward_context({layer.layer_name: md}, cfg, slot_mapping={layer.layer_name: slots}):
        t_layer = timeit(lambda: layer(q, k, v), reps=10 if max(q_lens) > 1 else 30)
    t_build = timeit(lambda: builder.build(common))
    if max(q_lens) > 1:
        return t_layer, t_build, None
    hf_k = torch.randn(b, NKV, max(seq_lens) - 1, D, dtype=dtype)
    hf_mask = (torch.arange(max(seq_lens))[None, :] >= max(seq_lens) - seq[:, None])[:, None, None]
    k1 = torch.randn(b, NKV, 1, D, dtype=dtype)

    def hf_like():
        kk, vv = torch.cat([hf_k, k1], 2), torch.cat([hf_k, k1], 2)
        F.scaled_dot_product_attention(q.reshape(b, NH, 1, D), kk, vv, attn_mask=hf_mask,
                                       enable_gqa=True)

    return t_layer, t_build, timeit(hf_like)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", torch.get_num_threads())))
    torch.manual_seed(0)
    ensure_model_parallel_initialized(1, 1)
    hf = LlamaConfig(hidden_size=NH * D, num_attention_heads=NH, num_key_value_heads=NKV,
                     num_hidden_layers=1, vocab_size=128)
    cfg = VllmConfig(model_config=ModelConfig(model="dummy", hf_config=hf))
    prompts = torch.randint(16, 257, (64,)).tolist()
    cases = {"decode B=1 seq 300": ([1], [300], True),
             "decode B=1 seq 300, consecutive blocks": ([1], [300], False),
             "decode B=64 seq 144..384": ([1] * 64, torch.randint(144, 385, (64,)).tolist(), True),
             "decode B=64 seq 16..384": ([1] * 64, torch.randint(16, 385, (64,)).tolist(), True),
             "prefill 64 prompts 16..256": (prompts, prompts, True)}
    print(f"threads={torch.get_num_threads()}  per-layer ms: layer (kv write + attn) | "
          f"builder per step | hf-like cat+sdpa")
    for i, dtype in enumerate((torch.bfloat16, torch.float32)):
        with set_current_vllm_config(cfg):
            torch.set_default_dtype(dtype)
            layer = Attention(NH, D, D ** -0.5, NKV, prefix=f"model.layers.{i}.attn")
            torch.set_default_dtype(torch.float32)
        for name, (q_lens, seq_lens, shuffle) in cases.items():
            t_layer, t_build, t_hf = run_case(q_lens, seq_lens, dtype, cfg, layer, shuffle)
            hf_txt = "-" if t_hf is None else f"{t_hf:7.3f}"
            print(f"{str(dtype)[6:]:9s} {name:40s} {t_layer:7.3f} | {t_build:6.3f} | {hf_txt}")


if __name__ == "__main__":
    main()
