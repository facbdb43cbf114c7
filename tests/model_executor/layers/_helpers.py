"""Shared helpers for the layer tests: a config context and the TP=2 worker (spawned processes)."""

import contextlib
import socket
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from minivllm.config import (CompilationConfig, DeviceConfig, ModelConfig, VllmConfig,
                             set_current_vllm_config)
from minivllm.distributed import (destroy_distributed_environment,
                                  ensure_model_parallel_initialized,
                                  init_distributed_environment, initialize_model_parallel)


def make_vllm_config(custom_ops: list[str] | None = None, device: str = "cpu") -> VllmConfig:
    hf_config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return VllmConfig(model_config=ModelConfig(model="dummy", hf_config=hf_config, dtype="float32"),
                      compilation_config=CompilationConfig(custom_ops=list(custom_ops or [])),
                      device_config=DeviceConfig(device=device))


@contextlib.contextmanager
def layer_context(custom_ops: list[str] | None = None) -> Iterator[VllmConfig]:
    """TP=PP=1 groups plus a current config: what every layer constructor needs."""
    ensure_model_parallel_initialized(1, 1)
    config = make_vllm_config(custom_ops)
    with set_current_vllm_config(config):
        yield config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tp2_worker(rank: int, port: int) -> None:
    """Build each TP layer at T=2 from full random weights; compare with the unsharded maths."""
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(2, 1)
    try:
        with set_current_vllm_config(make_vllm_config()):
            _check_linears(rank)
            _check_vocab_and_logits()
    finally:
        destroy_distributed_environment()


def _full(*shape: int, seed: int) -> torch.Tensor:
    # Same seed on both ranks -> both see the same "checkpoint" tensor.
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_linears(rank: int) -> None:
    from minivllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                       MergedColumnParallelLinear,
                                                       QKVParallelLinear, RowParallelLinear)

    H, I, d = 16, 24, 4
    x = _full(5, H, seed=1)
    w, b = _full(32, H, seed=2), _full(32, seed=3)
    col = ColumnParallelLinear(H, 32, bias=True, gather_output=True)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    assert col.weight.shape == (16, H)
    torch.testing.assert_close(col(x)[0], F.linear(x, w, b))

    gate, up = _full(I, H, seed=4), _full(I, H, seed=5)
    merged = MergedColumnParallelLinear(H, [I, I], bias=False)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    half = I // 2
    expected = torch.cat([gate[rank * half:(rank + 1) * half], up[rank * half:(rank + 1) * half]])
    torch.testing.assert_close(merged.weight.data, expected)

    # nH=4, nKV=1 < T=2: the single KV head is replicated on both ranks.
    q, k, v = _full(4 * d, H, seed=6), _full(d, H, seed=7), _full(d, H, seed=8)
    qkv = QKVParallelLinear(H, d, 4, 1, bias=False)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_head_replicas) == (2, 1, 2)
    for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
        qkv.weight.weight_loader(qkv.weight, tensor, shard_id)
    out = qkv(x)[0]
    torch.testing.assert_close(out, torch.cat([F.linear(x, q[rank * 2 * d:(rank + 1) * 2 * d]),
                                               F.linear(x, k), F.linear(x, v)], dim=-1))

    w_row, b_row = _full(H, 32, seed=9), _full(H, seed=10)
    row = RowParallelLinear(32, H, bias=True, input_is_parallel=False)
    row.weight.weight_loader(row.weight, w_row)
    row.bias.weight_loader(row.bias, b_row)
    x_row = _full(5, 32, seed=11)
    torch.testing.assert_close(row(x_row)[0], F.linear(x_row, w_row, b_row))


def _check_vocab_and_logits() -> None:
    from minivllm.model_executor.layers.logits_processor import LogitsProcessor
    from minivllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                         VocabParallelEmbedding)

    V, H = 100, 16  # padded to 128: rank 0 owns ids [0, 64), rank 1 ids [64, 100) + padding
    table = _full(V, H, seed=12)
    embed = VocabParallelEmbedding(V, H)
    embed.weight.weight_loader(embed.weight, table)
    ids = torch.tensor([0, 5, 63, 64, 70, 99])
    torch.testing.assert_close(embed(ids), F.embedding(ids, table))

    lm_head = ParallelLMHead(V, H)
    lm_head.weight.weight_loader(lm_head.weight, _full(V, H, seed=13))
    hidden = _full(6, H, seed=14)
    processor = LogitsProcessor(V)
    logits = processor(lm_head, hidden)
    torch.testing.assert_close(logits, F.linear(hidden, _full(V, H, seed=13)))
    assert processor(lm_head, hidden, skip_gather=True).shape == (6, 64)
    torch.testing.assert_close(processor.get_top_tokens(lm_head, hidden), logits.argmax(dim=-1))

    tied = ParallelLMHead(V, H).tie_weights(embed)
    assert tied.weight is embed.weight
    torch.testing.assert_close(processor(tied, hidden), F.linear(hidden, table))
