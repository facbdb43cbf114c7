"""Process groups for tensor and pipeline parallelism.

Rank layout (as vLLM's): global rank = pp_rank * TP + tp_rank. TP groups are runs of TP
consecutive ranks inside one pipeline stage; PP groups take every TP-th rank:
TP=2, PP=2 -> TP groups [0,1], [2,3]; PP groups [0,2], [1,3].
At world size 1 no torch.distributed group is needed: every collective is the identity.
"""

import pickle
from typing import Any

import torch
import torch.distributed as dist


class _OneRankGroup:
    """Stands in for the torch ProcessGroup of a one-rank group (no process group is created when
    running alone): model files ask it `size()` and `rank()`. Collectives over a one-rank group
    are identities, so the coordinator never hands it to torch.distributed."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class GroupCoordinator:
    """One communication group: its ranks, this process's place in it, and its collectives."""

    def __init__(self, ranks: list[int], rank: int, group: Any = None, name: str = "") -> None:
        self.ranks = ranks
        self.rank = rank                          # global rank of this process
        self.rank_in_group = ranks.index(rank)
        self.world_size = len(ranks)
        # torch ProcessGroup; a stand-in answering size() / rank() for a one-rank group
        self.device_group = group if group is not None or len(ranks) > 1 else _OneRankGroup()
        self.cpu_group = self.device_group
        self.unique_name = name

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        out = x.clone()
        dist.all_reduce(out, group=self.device_group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's `x` on group rank `dst`; other ranks get None."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        dist.gather(x.contiguous(), parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def send_object(self, obj: Any, dst: int) -> None:
        """Send a picklable object to group rank `dst` over the CPU group: length, then bytes."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=self.ranks[dst], group=self.cpu_group)
        dist.send(data, dst=self.ranks[dst], group=self.cpu_group)

    def recv_object(self, src: int) -> Any:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=self.ranks[src], group=self.cpu_group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src=self.ranks[src], group=self.cpu_group)
        return pickle.loads(data.numpy().tobytes())

    def send_tensor_dict(self, tensors: dict[str, torch.Tensor], dst: int | None = None) -> None:
        """Send a dict of tensors to group rank `dst` (default: the next rank): metadata, then data."""
        dst_rank = self.ranks[dst] if dst is not None else self.next_rank
        meta = pickle.dumps({k: (v.shape, v.dtype) for k, v in tensors.items()})
        size = torch.tensor([len(meta)], dtype=torch.int64)
        dist.send(size, dst=dst_rank, group=self.device_group)
        dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst=dst_rank, group=self.device_group)
        for value in tensors.values():
            dist.send(value.contiguous(), dst=dst_rank, group=self.device_group)

    def recv_tensor_dict(self, src: int | None = None) -> dict[str, torch.Tensor]:
        src_rank = self.ranks[src] if src is not None else self.prev_rank
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=src_rank, group=self.device_group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(buf, src=src_rank, group=self.device_group)
        meta = pickle.loads(buf.numpy().tobytes())
        out = {}
        for key, (shape, dtype) in meta.items():
            out[key] = torch.empty(shape, dtype=dtype)
            dist.recv(out[key], src=src_rank, group=self.device_group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
# Expert parallelism: with data parallel size 1 (always, here) an EP group holds the same ranks
# as the TP group of its stage; FusedMoE splits experts over it when expert parallel is enabled.
_EP: GroupCoordinator | None = None


def init_distributed_environment(world_size: int = 1, rank: int = 0,
                                 distributed_init_method: str = "env://", local_rank: int = 0,
                                 backend: str = "gloo", timeout_s: float = 600.0) -> None:
    """Join the world group; at world size 1 no process group is created."""
    global _WORLD
    if world_size > 1 and not dist.is_initialized():
        from datetime import timedelta

        dist.init_process_group(backend=backend, init_method=distributed_init_method,
                                world_size=world_size, rank=rank, timeout=timedelta(seconds=timeout_s))
    group = dist.group.WORLD if world_size > 1 else None
    _WORLD = GroupCoordinator(list(range(world_size)), rank, group, "world")


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1, backend: str | None = None) -> None:
    """Build the TP and PP groups (layout in the module docstring)."""
    global _TP, _PP, _EP
    if _WORLD is None:
        init_distributed_environment(tensor_model_parallel_size * pipeline_model_parallel_size)
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    world, rank = _WORLD.world_size, _WORLD.rank
    if world != tp * pp:
        raise ValueError(f"world size ({world}) must equal tensor_parallel_size ({tp}) x "
                         f"pipeline_parallel_size ({pp})")
    tp_groups = [list(range(s * tp, (s + 1) * tp)) for s in range(pp)]
    pp_groups = [list(range(t, world, tp)) for t in range(tp)]
    _TP = _make_group(tp_groups, rank, "tp")
    _PP = _make_group(pp_groups, rank, "pp")
    _EP = _make_group(tp_groups, rank, "ep")


def _make_group(all_ranks: list[list[int]], rank: int, name: str) -> GroupCoordinator:
    # NOTE: every process must call new_group for every group, in the same order.
    mine = None
    for ranks in all_ranks:
        group = dist.new_group(ranks) if dist.is_initialized() and len(ranks) > 1 else None
        if rank in ranks:
            mine = GroupCoordinator(ranks, rank, group, name)
    assert mine is not None
    return mine


def ensure_model_parallel_initialized(tensor_model_parallel_size: int = 1,
                                      pipeline_model_parallel_size: int = 1) -> None:
    if not model_parallel_is_initialized():
        initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
        return
    assert (_TP.world_size, _PP.world_size) == (tensor_model_parallel_size, pipeline_model_parallel_size), (
        "model parallel groups are already initialized with other sizes")


def model_parallel_is_initialized() -> bool:
    return _TP is not None and _PP is not None


def get_world_group() -> GroupCoordinator:
    assert _WORLD is not None, "world group is not initialized"
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    assert _TP is not None, "tensor model parallel group is not initialized"
    return _TP


def get_pp_group() -> GroupCoordinator:
    assert _PP is not None, "pipeline model parallel group is not initialized"
    return _PP


def get_ep_group() -> GroupCoordinator:
    """The expert-parallel group (the TP group's ranks: data parallel size is 1)."""
    assert _EP is not None, "expert parallel group is not initialized"
    return _EP


def get_dp_group() -> GroupCoordinator:
    """The data-parallel group: this rank alone, since minivllm runs one data-parallel replica
    (vLLM's `--data-parallel-size` 1); `world_size` 1 makes every collective the identity."""
    world = get_world_group()
    return GroupCoordinator([world.rank], world.rank, None, "dp")


def get_pcp_group() -> GroupCoordinator:
    """The prefill context-parallel group (vLLM 0.33): this rank alone, since minivllm does not
    split a prompt's tokens over ranks (`--prefill-context-parallel-size` 1)."""
    world = get_world_group()
    return GroupCoordinator([world.rank], world.rank, None, "pcp")


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    return get_pp_group().world_size


def get_pipeline_model_parallel_rank() -> int:
    return get_pp_group().rank_in_group


def destroy_model_parallel() -> None:
    global _TP, _PP, _EP
    _TP = _PP = _EP = None


def destroy_distributed_environment() -> None:
    global _WORLD
    destroy_model_parallel()
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()
