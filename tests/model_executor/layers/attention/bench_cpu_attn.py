"""Micro-benchmark (not a test): per-layer decode time of Attention on the CPU paged backend.

Run: python tests/model_executor/layers/attention/bench_cpu_attn.py
SmolLM2-135M geometry (nH=9, nKV=3, d=64), block size 16. "hf-like" is what a contiguous
DynamicCache + SDPA costs per layer (torch.cat of the cache, padded mask) for comparison.
"""

import os
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from minivllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from minivllm.distributed import ensure_model_parallel_initialized
from minivllm.forward_context import set_forward_context
from minivllm.model_executor.layers.attention import Attention
from minivllm.v1.attention.backends import CommonAttentionMetadata, TorchAttentionMetadataBuilder

NH, NKV, D, BS = 9, 3, 64, 16


def timeit(fn, reps: int = 15, inner: int = 10) -> float:
    """Min over `reps` of the mean over `inner` calls, in ms."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        for _ in range(inner):
            fn()
        times.append((time.thread_time() - t0) / inner * 1e3)
    return min(times)


def decode_case(seq_lens: list[int], dtype: torch.dtype, cfg: VllmConfig, layer: Attention):
    b = len(seq_lens)
    blocks = [-(-s // BS) for s in seq_lens]
    num_blocks = sum(blocks) + 8
    perm = torch.randperm(num_blocks)
    table = torch.zeros(b, max(blocks), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    seq = torch.tensor(seq_lens)
    slots = (table[torch.arange(b), (seq - 1) // BS].long() * BS + (seq - 1) % BS)
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32), seq_lens=seq.int(),
        block_table=table, slot_mapping=slots, num_actual_tokens=b, max_query_len=1,
        max_seq_len=max(seq_lens))
    builder = TorchAttentionMetadataBuilder(BS)
    layer.bind_kv_cache(torch.randn(layer.get_kv_cache_shape(num_blocks, BS), dtype=dtype))
    qkv = torch.randn(b, (NH + 2 * NKV) * D, dtype=dtype)
    q, k, v = qkv.split([NH * D, NKV * D, NKV * D], dim=-1)
    md = builder.build(common)

    def step():
        for _ in range(10):      # ten layers per forward context, as in a model step
            layer(q, k, v)

    hf_k = torch.randn(b, NKV, max(seq_lens) - 1, D, dtype=dtype)
    hf_mask = (torch.arange(max(seq_lens))[None, :] >= max(seq_lens) - seq[:, None])[:, None, None]
    k1 = torch.randn(b, NKV, 1, D, dtype=dtype)

    def hf_like():
        kk, vv = torch.cat([hf_k, k1], 2), torch.cat([hf_k, k1], 2)
        F.scaled_dot_product_attention(q.reshape(b, NH, 1, D), kk, vv, attn_mask=hf_mask,
                                       enable_gqa=True)

    with set_forward_context({layer.layer_name: md}, cfg, slot_mapping={layer.layer_name: slots}):
        t_layer = timeit(step) / 10
    return t_layer, timeit(lambda: builder.build(common)), timeit(hf_like)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", torch.get_num_threads())))
    torch.manual_seed(0)
    ensure_model_parallel_initialized(1, 1)
    hf = LlamaConfig(hidden_size=NH * D, num_attention_heads=NH, num_key_value_heads=NKV,
                     num_hidden_layers=1, vocab_size=128)
    cfg = VllmConfig(model_config=ModelConfig(model="dummy", hf_config=hf))
    cases = {"B=1 seq=300": [300],
             "B=64 seq 144..384": torch.randint(144, 385, (64,)).tolist(),
             "B=64 seq 16..384": torch.randint(16, 385, (64,)).tolist()}
    print(f"threads={torch.get_num_threads()}  per-layer ms: layer (kv write + attn) | "
          f"builder per step | hf-like cat+sdpa")
    for i, dtype in enumerate((torch.bfloat16, torch.float32)):
        with set_current_vllm_config(cfg):
            torch.set_default_dtype(dtype)
            layer = Attention(NH, D, D ** -0.5, NKV, prefix=f"model.layers.{i}.attn")
            torch.set_default_dtype(torch.float32)
        for name, lens in cases.items():
            t_layer, t_build, t_hf = decode_case(lens, dtype, cfg, layer)
            print(f"{str(dtype):15s} {name:32s} {t_layer:7.3f} | {t_build:6.3f} | {t_hf:7.3f}")


if __name__ == "__main__":
    main()
