"""TP collectives over two real gloo processes: reduce-scatter, and the DP group of size 1."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.distributed import (destroy_distributed_environment, get_dp_group,
                                  init_distributed_environment, initialize_model_parallel,
                                  tensor_model_parallel_reduce_scatter)
from minivllm.model_executor.parameter import row_parallel_weight_loader, sharded_weight_loader
from tests.model_executor.layers._helpers import free_port


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(2, 1)
    try:
        # Rank r holds (r + 1) * base; the sum is 3 * base, of which each keeps its half.
        base = torch.arange(24.0).view(2, 3, 4)
        for dim in (-1, 1, 0):
            out = tensor_model_parallel_reduce_scatter(base * (rank + 1), dim=dim)
            expected = (3 * base).chunk(2, dim=dim)[rank]
            assert torch.equal(out, expected), (dim, out, expected)
        dp = get_dp_group()
        assert (dp.world_size, dp.rank_in_group, dp.ranks) == (1, 0, [rank])
        assert torch.equal(dp.all_reduce(base), base)
        # The sharded loaders keep this rank's slice.
        full = torch.arange(8.0).view(2, 4)
        param = torch.nn.Parameter(torch.empty(2, 2), requires_grad=False)
        sharded_weight_loader(1)(param, full)
        assert torch.equal(param.data, full[:, 2 * rank:2 * rank + 2])
        param.input_dim = 1
        param.data.zero_()
        row_parallel_weight_loader(param, full)
        assert torch.equal(param.data, full[:, 2 * rank:2 * rank + 2])
    finally:
        destroy_distributed_environment()


def test_reduce_scatter_and_sharded_loaders_tp2():
    fork_ok = "fork" in mp.get_all_start_methods() and not dist.is_initialized()
    mp.start_processes(_worker, args=(free_port(),), nprocs=2, join=True,
                       start_method="fork" if fork_ok else "spawn")
