"""`MiniMaxText01RMSNormTP`: an RMSNorm whose normalised vector is the whole q (or k) of a token,
every head together, while each TP rank holds only its heads' slice of it.

Each rank computes the mean of squares of its slice [T, 1]; the TP group sums them and divides by
the TP size, which is the full vector's mean because the slices are equally long. The weight is
sharded like the heads (`weight_shard_*` when KV heads are replicated over more ranks than there
are heads). vLLM fuses the all-reduce into GPU kernels; here it is one `all_reduce` of [T, 2].
"""

from functools import partial

import torch
from torch import nn

from minivllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)
from minivllm.distributed.communication_op import tensor_model_parallel_all_reduce
from minivllm.model_executor.custom_op import CustomOp


@CustomOp.register("minimax_text01_rmsnorm_tp")
class MiniMaxText01RMSNormTP(CustomOp):
    """`forward(x [T, hidden_size / shards])` -> x normalised over the full, unsharded width."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 weight_shard_world_size: int | None = None,
                 weight_shard_rank: int | None = None) -> None:
        super().__init__()
        self.tp_world = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank() if self.tp_world > 1 else 0
        self.weight_shard_world = weight_shard_world_size or self.tp_world
        self.weight_shard_rank = self.tp_rank if weight_shard_rank is None else weight_shard_rank
        if hidden_size % self.weight_shard_world:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by the "
                             f"{self.weight_shard_world} weight shards")
        self.weight = nn.Parameter(torch.ones(hidden_size // self.weight_shard_world),
                                   requires_grad=False)
        self.weight.weight_loader = partial(self.weight_loader,
                                            shard_world_size=self.weight_shard_world,
                                            shard_rank=self.weight_shard_rank)
        self.variance_epsilon = eps

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_world_size: int | None = None,
                      shard_rank: int | None = None) -> None:
        """This rank's contiguous slice of the full [hidden_size] weight."""
        if shard_world_size is None:
            shard_world_size = get_tensor_model_parallel_world_size()
        if shard_rank is None:
            shard_rank = get_tensor_model_parallel_rank() if shard_world_size > 1 else 0
        size = loaded_weight.shape[0] // shard_world_size
        if size != param.shape[0]:
            raise ValueError(f"norm weight of {loaded_weight.shape[0]} over {shard_world_size} "
                             f"shards does not fit a parameter of {param.shape[0]}")
        param.data.copy_(loaded_weight[shard_rank * size:(shard_rank + 1) * size])

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None
                       ) -> torch.Tensor:
        if residual is not None:
            raise NotImplementedError("MiniMaxText01RMSNormTP takes no residual")
        variance = _global_mean_square([x.float()], self.tp_world)[0]
        return _apply(x, variance, self.weight, self.variance_epsilon)

    @staticmethod
    def forward_qk(q_norm: "MiniMaxText01RMSNormTP", k_norm: "MiniMaxText01RMSNormTP",
                   q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, q_size] and k [T, kv_size] normalised, their variances reduced together."""
        q_var, k_var = _global_mean_square([q.float(), k.float()], q_norm.tp_world)
        return (_apply(q, q_var, q_norm.weight, q_norm.variance_epsilon),
                _apply(k, k_var, k_norm.weight, k_norm.variance_epsilon))

    @staticmethod
    def forward_qkv(q_norm: "MiniMaxText01RMSNormTP", k_norm: "MiniMaxText01RMSNormTP",
                    qkv: torch.Tensor, q_size: int, kv_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a fused qkv [T, q_size + 2 * kv_size]; q and k come back normalised."""
        if qkv.dim() != 2:
            raise ValueError(f"qkv must be [num_tokens, q_size + 2 * kv_size], got "
                             f"{tuple(qkv.shape)}")
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = MiniMaxText01RMSNormTP.forward_qk(q_norm, k_norm, q, k)
        return q, k, v


def _global_mean_square(parts: list[torch.Tensor], tp_world: int) -> list[torch.Tensor]:
    """mean(x^2) over each part's last dim [T, 1], averaged over the TP ranks' equal slices:
    one all-reduce of the stacked [T, len(parts)] (fp32)."""
    local = torch.cat([p.pow(2).mean(dim=-1, keepdim=True) for p in parts], dim=-1)
    if tp_world > 1:
        local = tensor_model_parallel_all_reduce(local) / tp_world
    return list(local.split(1, dim=-1))


def _apply(x: torch.Tensor, variance: torch.Tensor, weight: torch.Tensor,
           eps: float) -> torch.Tensor:
    """x * rsqrt(variance + eps) * weight in fp32, rounded once to x's dtype."""
    return (x.float() * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)
