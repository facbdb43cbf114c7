"""TP=2 in two real gloo processes: every sharded layer reproduces the unsharded computation."""

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.model_executor.layers._helpers import free_port, tp2_worker


def test_tp2_layers_match_unsharded():
    # fork skips re-importing torch/transformers in the children (~0.5 s instead of 5-20 s);
    # spawn is the fallback where fork is unavailable or this process already joined a group.
    fork_ok = "fork" in mp.get_all_start_methods() and not dist.is_initialized()
    mp.start_processes(tp2_worker, args=(free_port(),), nprocs=2, join=True,
                       start_method="fork" if fork_ok else "spawn")
