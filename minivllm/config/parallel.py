"""ParallelConfig: TP x PP layout and where the ranks meet."""

import os
from dataclasses import dataclass, field


EXECUTOR_BACKENDS = ("mp", "uni")


@dataclass
class EPLBConfig:
    """vLLM's expert-load-balancer settings, which MoE model files read. minivllm has no balancer:
    experts are placed once, so there are no redundant copies."""

    num_redundant_experts: int = 0

    def __post_init__(self) -> None:
        if self.num_redundant_experts != 0:
            raise ValueError("redundant experts need expert load balancing (EPLB), which is not "
                             "supported; num_redundant_experts must be 0")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"   # spawned worker processes
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None             # None = pick a free port (single node)
    rank: int = 0                              # this process's global rank (workers)
    # Split MoE experts over the TP ranks (whole experts per rank) instead of slicing every
    # expert's intermediate dimension.
    enable_expert_parallel: bool = False
    # Read by vLLM 0.33's MoE files; only the values minivllm honours are accepted.
    enable_eplb: bool = False
    eplb_config: EPLBConfig = field(default_factory=EPLBConfig)
    expert_placement_strategy: str = "linear"     # contiguous runs of experts per rank
    # vLLM's: "module:Class" (or "module.Class") mixed into the Worker class, for collective_rpc
    worker_extension_cls: str = ""
    # vLLM's: "mp" (a worker process per rank), "uni" (the one rank in the engine's process);
    # None: uni for one rank, mp for several.
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        if self.enable_eplb:
            raise ValueError("expert load balancing (enable_eplb) is not supported")
        if self.expert_placement_strategy != "linear":
            raise ValueError(f"expert_placement_strategy {self.expert_placement_strategy!r} is "
                             "not supported; choose 'linear'")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        backend = self.distributed_executor_backend
        if backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"distributed_executor_backend {backend!r} is not supported; "
                             f"choose one of {', '.join(EXECUTOR_BACKENDS)}")
        if backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank in this "
                             f"process; this engine has {self.world_size} (use 'mp')")
        if self.world_size % self.nnodes != 0:
            raise ValueError(f"world size {self.world_size} (TP x PP) must be divisible by nnodes={self.nnodes}")

    @property
    def use_sequence_parallel_moe(self) -> bool:
        """vLLM splits MoE tokens over TP ranks only under data parallelism (size 1 here)."""
        return False

    @property
    def decode_context_parallel_size(self) -> int:
        """vLLM's DCP / PCP split the KV cache's tokens over ranks; minivllm has neither."""
        return 1

    @property
    def prefill_context_parallel_size(self) -> int:
        return 1

    @property
    def dcp_q_replicate(self) -> bool:
        return False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @staticmethod
    def from_torchrun_env() -> dict:
        """Read torchrun's variables (MASTER_ADDR, MASTER_PORT, ...) when they are set."""
        env: dict = {}
        if "MASTER_ADDR" in os.environ:
            env["master_addr"] = os.environ["MASTER_ADDR"]
        if "MASTER_PORT" in os.environ:
            env["master_port"] = int(os.environ["MASTER_PORT"])
        if "GROUP_RANK" in os.environ:
            env["node_rank"] = int(os.environ["GROUP_RANK"])
        if "NNODES" in os.environ:
            env["nnodes"] = int(os.environ["NNODES"])
        return env
