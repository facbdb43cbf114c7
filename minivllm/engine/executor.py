"""Executors: how the engine reaches its worker(s). In-process for a single rank."""

from minivllm.config import VllmConfig
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.worker.worker import Worker


class UniProcExecutor:
    """One worker in this process (TP = PP = 1)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.worker = Worker(vllm_config, rank=0)
        self.worker.init_device()
        self.worker.load_model()
        self.num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(self.num_blocks)
        self.worker.compile_or_warm_up_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass


def create_executor(vllm_config: VllmConfig):
    if vllm_config.parallel_config.world_size == 1:
        return UniProcExecutor(vllm_config)
    from minivllm.engine.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(vllm_config)
