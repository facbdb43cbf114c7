"""How one MoE layer is split and shaped (vLLM 0.33's `FusedMoEParallelConfig` / `FusedMoEConfig`):
model files read these off the routed experts (`experts.moe_config`) when they load weights
themselves. minivllm runs one data-parallel replica and no context parallelism, so only TP
and EP vary."""

from dataclasses import dataclass


@dataclass(frozen=True)
class FusedMoEParallelConfig:
    """This rank's place for one MoE layer: TP slices every expert, EP hands out whole ones."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    pcp_size: int = 1
    pcp_rank: int = 0

    @property
    def use_ep(self) -> bool:
        return self.ep_size > 1

    @staticmethod
    def flatten_tp_across_dp_and_pcp(tp_size: int, dp_size: int, dp_rank: int,
                                     pcp_size: int = 1, pcp_rank: int = 0
                                     ) -> tuple[int, int]:
        """(size, rank) of the group that slices experts when EP is off: vLLM folds the data-
        and context-parallel replicas into it; with both at size 1 that is the TP group."""
        from minivllm.distributed import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
        return (tp_size * dp_size * pcp_size,
                (pcp_rank * dp_size + dp_rank) * tp_size + tp_rank)


@dataclass(frozen=True)
class FusedMoEConfig:
    """One MoE layer's sizes (per rank where stated) and its parallel split."""

    num_experts: int
    experts_per_token: int
    hidden_dim: int
    intermediate_size_per_partition: int
    num_local_experts: int
    moe_parallel_config: FusedMoEParallelConfig
    activation: str
    has_bias: bool

    @property
    def is_act_and_mul(self) -> bool:
        from minivllm.model_executor.layers.fused_moe.activation import is_gated
        return is_gated(self.activation)   # False for the "*_no_mul" ones (up rows only)

    @property
    def tp_size(self) -> int:
        return self.moe_parallel_config.tp_size

    @property
    def ep_size(self) -> int:
        return self.moe_parallel_config.ep_size
