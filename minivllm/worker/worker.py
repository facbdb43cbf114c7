"""One rank: joins the process groups, loads its model shard, owns its KV cache, runs steps."""

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from minivllm.config import VllmConfig
from minivllm.distributed import (ensure_model_parallel_initialized, get_pp_group,
                                  init_distributed_environment)
from minivllm.lora.request import LoRARequest
from minivllm.model_executor.model_loader.weight_iterators import safetensors_weights_iterator
from minivllm.sequence import IntermediateTensors
from minivllm.utils.import_utils import resolve_obj_by_qualname
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.worker import sleep_mode
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.sleep_mode import SleepState


class Worker:
    def __init__(self, vllm_config: VllmConfig, rank: int = 0,
                 distributed_init_method: str = "env://") -> None:
        self.vllm_config = vllm_config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.model_runner = ModelRunner(vllm_config, vllm_config.device_config.device)
        self.sleep_state = SleepState()

    def init_device(self, timeout_s: float = 600.0) -> None:
        """Join the world (gloo on CPU, NCCL on CUDA; `timeout_s` bounds a hung collective)."""
        pc = self.vllm_config.parallel_config
        local_rank = self.rank % (pc.world_size // pc.nnodes)
        backend = "gloo"
        if self.vllm_config.device_config.device == "cuda":
            backend = "nccl"
            torch.cuda.set_device(local_rank)   # "cuda" now means this rank's GPU
        init_distributed_environment(pc.world_size, self.rank, self.distributed_init_method,
                                     local_rank=local_rank, backend=backend, timeout_s=timeout_s)
        ensure_model_parallel_initialized(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        torch.manual_seed(self.vllm_config.model_config.seed)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def compile_or_warm_up_model(self) -> None:
        self.model_runner.compile_or_warm_up_model()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into this rank's cache (ValueError when it does not fit the model)."""
        return self.model_runner.lora_manager_or_raise().add_adapter(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_runner.lora_manager_or_raise().remove_adapter(lora_id)

    def list_loras(self) -> set[int]:
        return self.model_runner.lora_manager_or_raise().list_adapters()

    def get_model(self) -> torch.nn.Module:
        """This rank's model (its TP shard, its PP stage)."""
        return self.model_runner.model

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> Any:
        """vLLM's: `func(model)` on this rank (`LLM.apply_model` runs it on every rank)."""
        return func(self.get_model())

    def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
                       weights_path: str | None = None) -> None:
        """vLLM's: loads new weights into the running model, in checkpoint format: the given
        (name, tensor) pairs, else a checkpoint folder's safetensors, else the model's own
        checkpoint again. Each rank takes its shard. ValueError for a model whose layers
        cannot be reloaded (quantized ones). The KV already cached was computed with the old
        weights: reset the prefix cache after (`LLM.reset_prefix_cache()`)."""
        model = self.model_runner.model
        if weights_iterator is None:
            path = weights_path or self.vllm_config.model_config.model
            if not os.path.isdir(path):
                raise ValueError(f"reload_weights reads a checkpoint folder of safetensors; "
                                 f"{path!r} is not one")
            weights_iterator = safetensors_weights_iterator(path)
        model.load_weights(weights_iterator)

    def sleep(self, level: int = 1) -> None:
        """vLLM's: frees this rank's KV cache (level 1), and its weights (level 2)."""
        sleep_mode.sleep(self.model_runner, self.sleep_state, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: takes back the weights and / or the KV cache (`tags`; None: both)."""
        sleep_mode.wake_up(self.model_runner, self.sleep_state, tags)

    def start_profile(self, trace_dir: str, record_shapes: bool = False,
                      with_stack: bool = True) -> None:
        """vLLM's torch profiler on this rank, until `stop_profile` writes its trace (gzipped
        Chrome / TensorBoard format, named after the rank) into `trace_dir`."""
        if getattr(self, "profiler", None) is not None:
            raise ValueError("The profiler is already running; call stop_profile first.")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities, record_shapes=record_shapes, with_stack=with_stack,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                trace_dir, worker_name=f"rank{self.rank}", use_gzip=True))
        self.profiler.start()

    def stop_profile(self) -> None:
        if getattr(self, "profiler", None) is None:
            raise ValueError("The profiler is not running; call start_profile first.")
        profiler, self.profiler = self.profiler, None
        profiler.stop()   # writes the trace

    def apply_sampled_tokens(self, sampled: dict[str, list[int]]) -> None:
        """Learn the tokens the last PP stage sampled in the previous step.

        Only the last stage samples; earlier stages need those tokens as the next step's input
        ids (the scheduler's deltas carry block ids and counts, not tokens).
        """
        if get_pp_group().is_last_rank:
            return
        states = self.model_runner.states
        for req_id, token_ids in sampled.items():
            state = states.get(req_id)
            if state is not None:
                state.token_ids.extend(token_ids)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; PP stages receive from the previous stage and send to the next."""
        pp = get_pp_group()
        intermediate = None
        if not pp.is_first_rank and scheduler_output.total_num_scheduled_tokens > 0:
            intermediate = IntermediateTensors(pp.recv_tensor_dict())
        output = self.model_runner.execute_model(scheduler_output, intermediate)
        if isinstance(output, IntermediateTensors):
            pp.send_tensor_dict(output.tensors)
            return None
        return output if pp.is_last_rank else None


def get_worker_cls(parallel_config: Any) -> type[Worker]:
    """The Worker class, with vLLM's `worker_extension_cls` mixed in when one is named: its
    methods become callable by name through `collective_rpc`. ValueError for a name that does
    not load, or for an extension that would replace a Worker attribute."""
    name = getattr(parallel_config, "worker_extension_cls", "")
    if not name:
        return Worker
    try:
        ext = resolve_obj_by_qualname(name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"Cannot load worker_extension_cls {name!r}: {exc}") from None
    if not isinstance(ext, type):
        raise ValueError(f"worker_extension_cls {name!r} is not a class.")
    clashes = sorted(n for n in vars(ext) if not n.startswith("__") and hasattr(Worker, n))
    if clashes:
        raise ValueError(f"worker_extension_cls {name!r} would replace Worker's "
                         f"{', '.join(clashes)}; give its methods other names.")
    return type(f"Worker+{ext.__name__}", (Worker, ext), {})
