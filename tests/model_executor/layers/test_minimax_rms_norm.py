"""`MiniMaxText01RMSNormTP` (vLLM's layers/minimax_rms_norm): RMSNorm over all heads of q and k,
against the full-width maths, in one process and split over TP=2 gloo processes (each rank
normalises its head slice by the variance of the whole vector)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.config import set_current_vllm_config
from minivllm.distributed import (destroy_distributed_environment, init_distributed_environment,
                                  initialize_model_parallel)
from minivllm.model_executor.layers.minimax_rms_norm import MiniMaxText01RMSNormTP
from tests.model_executor.layers._helpers import free_port, layer_context, make_vllm_config

Q, KV, T, EPS = 32, 16, 5, 1e-5


def _full(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def test_forward_qkv_normalises_q_and_k_over_their_full_width():
    qkv, wq, wk = _full(T, Q + 2 * KV, seed=1) * 3, _full(Q, seed=2), _full(KV, seed=3)
    with layer_context():
        q_norm, k_norm = MiniMaxText01RMSNormTP(Q, EPS), MiniMaxText01RMSNormTP(KV, EPS)
    q_norm.weight.weight_loader(q_norm.weight, wq)
    k_norm.weight.weight_loader(k_norm.weight, wk)
    q, k, v = MiniMaxText01RMSNormTP.forward_qkv(q_norm, k_norm, qkv, Q, KV)
    torch.testing.assert_close(q.double(), _reference(qkv[:, :Q], wq))
    torch.testing.assert_close(k.double(), _reference(qkv[:, Q:Q + KV], wk))
    assert torch.equal(v, qkv[:, Q + KV:])
    torch.testing.assert_close(q_norm(qkv[:, :Q]), q)
    # bf16 in, bf16 out: normalised and weighted in fp32, rounded once.
    q16 = q_norm(qkv[:, :Q].bfloat16())
    assert q16.dtype == torch.bfloat16
    torch.testing.assert_close(q16.float(), q, atol=2e-2, rtol=2e-2)


def test_bad_inputs_are_refused():
    with layer_context():
        norm = MiniMaxText01RMSNormTP(Q, EPS)
        with pytest.raises(ValueError, match="not divisible"):
            MiniMaxText01RMSNormTP(30, EPS, weight_shard_world_size=4)
    with pytest.raises(NotImplementedError, match="takes no residual"):
        norm(torch.zeros(2, Q), torch.zeros(2, Q))
    with pytest.raises(ValueError, match="num_tokens"):
        MiniMaxText01RMSNormTP.forward_qkv(norm, norm, torch.zeros(1, 2, Q * 3), Q, Q)


def _tp2_worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(2, 1)
    try:
        with set_current_vllm_config(make_vllm_config()):
            qkv_full = _full(T, Q + 2 * KV, seed=4) * 2
            wq, wk = _full(Q, seed=5), _full(KV, seed=6)
            q_norm = MiniMaxText01RMSNormTP(Q, EPS)
            # One KV head group per rank pair: k's weight split over 2 "head" shards anyway.
            k_norm = MiniMaxText01RMSNormTP(KV, EPS, weight_shard_world_size=2,
                                            weight_shard_rank=rank)
            q_norm.weight.weight_loader(q_norm.weight, wq)
            k_norm.weight.weight_loader(k_norm.weight, wk)
            q_loc, k_loc = Q // 2, KV // 2
            # This rank's columns of the fused output: its q heads, its k heads, its v heads.
            local = torch.cat([qkv_full[:, rank * q_loc:(rank + 1) * q_loc],
                               qkv_full[:, Q + rank * k_loc:Q + (rank + 1) * k_loc],
                               qkv_full[:, Q + KV + rank * k_loc:Q + KV + (rank + 1) * k_loc]],
                              dim=1)
            q, k, _ = MiniMaxText01RMSNormTP.forward_qkv(q_norm, k_norm, local, q_loc, k_loc)
            ref_q = _reference(qkv_full[:, :Q], wq)[:, rank * q_loc:(rank + 1) * q_loc]
            ref_k = _reference(qkv_full[:, Q:Q + KV], wk)[:, rank * k_loc:(rank + 1) * k_loc]
            torch.testing.assert_close(q.double(), ref_q)
            torch.testing.assert_close(k.double(), ref_k)
    finally:
        destroy_distributed_environment()


def test_tp2_ranks_normalise_by_the_whole_vector():
    fork_ok = "fork" in mp.get_all_start_methods() and not dist.is_initialized()
    mp.start_processes(_tp2_worker, args=(free_port(),), nprocs=2, join=True,
                       start_method="fork" if fork_ok else "spawn")
