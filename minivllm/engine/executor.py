"""Executors: how the engine reaches its worker(s). In-process for a single rank."""

from collections.abc import Callable
from typing import Any

from minivllm.config import VllmConfig
from minivllm.engine.multiproc_executor import MultiprocExecutor
from minivllm.lora.request import LoRARequest
from minivllm.v1.serial_utils import run_method
from minivllm.worker.worker import get_worker_cls


class UniProcExecutor:
    """One worker in this process (TP = PP = 1)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.worker = get_worker_cls(vllm_config.parallel_config)(vllm_config, rank=0)
        self.worker.init_device()
        self.worker.load_model()
        self.num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(self.num_blocks)
        self.worker.compile_or_warm_up_model()
        # NOTE: a single rank has no pipeline stages to exchange tensors with, which is all
        # `Worker.execute_model` adds, so the engine's step calls the model runner directly.
        self.execute_model = self.worker.model_runner.execute_model

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.worker.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.worker.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.worker.list_loras()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """`method` on the one worker (a name, or a function taking the worker first)."""
        return [run_method(self.worker, method, tuple(args), kwargs)]

    def shutdown(self) -> None:
        pass


def create_executor(vllm_config: VllmConfig) -> UniProcExecutor | MultiprocExecutor:
    """In this process for one rank (or `distributed_executor_backend="uni"`), else (or with
    "mp") a worker process per rank."""
    pc = vllm_config.parallel_config
    if pc.distributed_executor_backend == "uni" or (
            pc.world_size == 1 and pc.distributed_executor_backend is None):
        return UniProcExecutor(vllm_config)
    get_worker_cls(vllm_config.parallel_config)   # a bad extension fails before any process starts
    return MultiprocExecutor(vllm_config)
