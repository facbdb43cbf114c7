"""Distributed API: process groups and the collectives layers call."""

from minivllm.distributed.communication_op import (tensor_model_parallel_all_gather,
                                                   tensor_model_parallel_all_reduce,
                                                   tensor_model_parallel_gather,
                                                   tensor_model_parallel_reduce_scatter)
from minivllm.distributed.parallel_state import (GroupCoordinator, destroy_distributed_environment,
                                                 destroy_model_parallel,
                                                 ensure_model_parallel_initialized,
                                                 get_dp_group, get_ep_group, get_pcp_group,
                                                 get_pipeline_model_parallel_rank,
                                                 get_pipeline_model_parallel_world_size,
                                                 get_pp_group, get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size, get_tp_group,
                                                 get_world_group, init_distributed_environment,
                                                 initialize_model_parallel,
                                                 model_parallel_is_initialized)
from minivllm.distributed.utils import divide, get_pp_indices, split_tensor_along_last_dim

__all__ = [
    "GroupCoordinator", "destroy_distributed_environment", "destroy_model_parallel", "divide",
    "ensure_model_parallel_initialized", "get_dp_group", "get_ep_group", "get_pcp_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size", "get_pp_group", "get_pp_indices",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_tp_group",
    "get_world_group", "init_distributed_environment", "initialize_model_parallel",
    "model_parallel_is_initialized", "tensor_model_parallel_all_gather",
    "split_tensor_along_last_dim", "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather", "tensor_model_parallel_reduce_scatter",
]
