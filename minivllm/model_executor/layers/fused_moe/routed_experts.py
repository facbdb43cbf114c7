"""`RoutedExperts`: the expert weights of a MoE layer and their computation, sharded by tensor or
expert parallelism (vLLM 0.33's name; `FusedMoEFactory` and the older `FusedMoE` build on it).

Parameters (vLLM's layout): `w13_weight [E_local, 2 * I_p, H]` (each expert's gate rows, then
its up rows; alternating gate, up rows for the "swigluoai" activation) and `w2_weight [E_local, H, I_p]`, optional `w13_bias [E_local, 2 * I_p]` and
`w2_bias [E_local, H]`. Checkpoint tensors arrive one expert and one shard at a time through
`weight_loader(param, w, weight_name, shard_id, expert_id)`, `shard_id` "w1" (gate), "w3" (up)
or "w2" (down); `make_expert_params_mapping` names them. `load_weights` also takes the stacked
tensors transformers writes (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, or transposed).

Sharding, T = TP size (data parallel size is 1):
- tensor parallel (default): every rank holds all E experts, each sliced to I_p = I / T of its
  intermediate dimension; the partial outputs are summed over the TP group;
- expert parallel (`ParallelConfig.enable_expert_parallel`, `--enable-expert-parallel`): the EP
  group (`get_ep_group`, the TP group's ranks) splits the experts into contiguous runs, rank r
  holding whole experts (I_p = I); every rank routes all tokens, runs its own experts and the
  outputs are summed over the group.
The experts return this rank's partial sum; `maybe_all_reduce_tensor_model_parallel` adds them.
"""

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.config import get_current_vllm_config
from minivllm.distributed import (get_ep_group, get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)
from minivllm.logger import init_logger
from minivllm.model_executor.custom_op import PluggableLayer
from minivllm.model_executor.layers.fused_moe.activation import is_gated
from minivllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig
from minivllm.model_executor.layers.fused_moe.fused_moe import ACTIVATIONS, fused_experts_op
from minivllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from minivllm.model_executor.models.auto_weights_loader import UnexpectedWeightsError
from minivllm.model_executor.parameter import set_weight_attrs

logger = init_logger(__name__)
_WARNED: set[type] = set()

ExpertMapping = list[tuple[str, str, int, str]]
_SHARD_IDS = ("w1", "w2", "w3")
# Stacked checkpoint tensors (all experts in one) -> the parameter they fill.
_STACKED = {"gate_up_proj": "w13_weight", "w13": "w13_weight", "down_proj": "w2_weight",
            "w2": "w2_weight", "gate_up_proj_bias": "w13_bias", "down_proj_bias": "w2_bias"}


def determine_expert_map(ep_size: int, ep_rank: int,
                         global_num_experts: int) -> tuple[int, torch.Tensor | None]:
    """(local expert count, `expert_map` [E] global id -> local row, -1 elsewhere).

    Contiguous runs, the first `E % ep_size` ranks one expert more: 10 experts over 4 ranks ->
    3, 3, 2, 2. No map at EP size 1.
    """
    if ep_size == 1:
        return global_num_experts, None
    base, extra = divmod(global_num_experts, ep_size)
    local = base + (1 if ep_rank < extra else 0)
    start = ep_rank * base + min(ep_rank, extra)
    expert_map = torch.full((global_num_experts,), -1, dtype=torch.int64)
    expert_map[start:start + local] = torch.arange(local)
    return local, expert_map


def build_expert_params_mapping(ckpt_gate_proj_name: str, ckpt_down_proj_name: str,
                                ckpt_up_proj_name: str | None, num_experts: int,
                                param_prefix: str = "experts.") -> ExpertMapping:
    """[(param_name, weight_name, expert_id, shard_id)], e.g. ("experts.w13_",
    "experts.3.gate_proj.", 3, "w1"): a checkpoint name containing `weight_name` loads into
    `param_name + <rest>` ("weight" / "bias"). `param_prefix` is where the parameters sit
    ("experts.routed_experts." for a `FusedMoEFactory` layer)."""
    shards = [("w1", ckpt_gate_proj_name), ("w2", ckpt_down_proj_name), ("w3", ckpt_up_proj_name)]
    return [(f"{param_prefix}w13_" if shard_id != "w2" else f"{param_prefix}w2_",
             f"experts.{expert_id}.{weight_name}.", expert_id, shard_id)
            for expert_id in range(int(num_experts)) for shard_id, weight_name in shards
            if weight_name is not None]


class RoutedExperts(PluggableLayer):
    """The experts alone: `forward_modular(x [T, H], topk_weights [T, k], topk_ids [T, k])`
    returns this rank's part of sum_j w[t, j] * expert_{id[t, j]}(x[t]), [T, H]."""

    def __init__(self, layer_name: str, params_dtype: torch.dtype | None, *, num_experts: int,
                 hidden_size: int, intermediate_size: int, quant_config: object = None,
                 tp_size: int | None = None, ep_size: int | None = None,
                 activation: str = "silu", has_bias: bool = False,
                 apply_router_weight_on_input: bool = False,
                 ckpt_names: tuple[str, str, str | None] = ("gate_proj", "down_proj", "up_proj"),
                 is_fused_checkpoint_transposed: bool = False,
                 expert_mapping: ExpertMapping | None = None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"Unsupported MoE activation {activation!r}; choose one of "
                             f"{', '.join(ACTIVATIONS)}")
        self.prefix = layer_name          # the checkpoint's name of these experts
        self.global_num_experts = num_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.has_bias = activation, has_bias
        # Non-gated experts ("relu2_no_mul"): w13 holds only the up rows [I_p, H], shard "w1".
        self.is_act_and_mul = is_gated(activation)
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.is_fused_checkpoint_transposed = is_fused_checkpoint_transposed
        self._init_parallel(tp_size, ep_size)
        self.expert_mapping = expert_mapping or build_expert_params_mapping(
            *ckpt_names, num_experts)
        self.quant_method = _moe_quant_method(self, quant_config, layer_name)
        if self.quant_method is not None and activation == "swigluoai":
            raise NotImplementedError("quantized experts keep gate rows first: use activation "
                                      "'swigluoai_uninterleave' instead of 'swigluoai'")
        if self.quant_method is not None and not self.is_act_and_mul:
            raise NotImplementedError(f"quantized non-gated experts ({activation!r}) are not "
                                      f"supported; gated ones are: silu, gelu, gelu_tanh")
        self._create_weights(params_dtype or torch.get_default_dtype())

    def _init_parallel(self, tp_size: int | None, ep_size: int | None) -> None:
        """TP slices every expert; EP (when enabled and TP > 1) hands whole experts to ranks."""
        group_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        self.use_ep = bool(get_current_vllm_config().parallel_config.enable_expert_parallel
                           and group_size > 1) or (ep_size or 1) > 1
        if self.use_ep:
            self.ep_size = ep_size or group_size
            self.ep_rank = get_ep_group().rank_in_group if self.ep_size > 1 else 0
            self.tp_size, self.tp_rank = 1, 0
            if self.global_num_experts < self.ep_size:
                raise ValueError(f"expert parallel size ({self.ep_size}) is larger than the "
                                 f"number of experts ({self.global_num_experts})")
        else:
            self.ep_size, self.ep_rank = 1, 0
            self.tp_size = group_size
            self.tp_rank = get_tensor_model_parallel_rank() if group_size > 1 else 0
            if self.intermediate_size % self.tp_size:
                valid = [t for t in range(1, self.intermediate_size + 1)
                         if self.intermediate_size % t == 0 and t <= 64]
                raise ValueError(f"MoE intermediate_size ({self.intermediate_size}) is not "
                                 f"divisible by tensor parallel size ({self.tp_size}); valid "
                                 f"sizes: {valid}, or use --enable-expert-parallel")
        self.local_num_experts, expert_map = determine_expert_map(
            self.ep_size, self.ep_rank, self.global_num_experts)
        self.register_buffer("expert_map", expert_map, persistent=False)
        self.intermediate_size_per_partition = self.intermediate_size // self.tp_size

    def _create_weights(self, dtype: torch.dtype) -> None:
        e, h, i = self.local_num_experts, self.hidden_size, self.intermediate_size_per_partition
        if self.quant_method is not None:
            self.quant_method.create_weights(self, e, h, i, dtype,
                                             weight_loader=self.weight_loader)
            return
        rows = 2 * i if self.is_act_and_mul else i      # gate + up rows, or up rows alone
        shapes = {"w13_weight": (e, rows, h), "w2_weight": (e, h, i)}
        if self.has_bias:
            shapes |= {"w13_bias": (e, rows), "w2_bias": (e, h)}
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(param, {"weight_loader": self.weight_loader})
            self.register_parameter(name, param)
        if not self.has_bias:
            self.w13_bias = self.w2_bias = None

    @staticmethod
    def make_expert_params_mapping(model: nn.Module | None, ckpt_gate_proj_name: str,
                                   ckpt_down_proj_name: str, ckpt_up_proj_name: str | None,
                                   num_experts: int, num_redundant_experts: int = 0,
                                   routed_experts_prefix: str = "routed_experts"
                                   ) -> ExpertMapping:
        """vLLM 0.33's mapping for model files that index `named_parameters()` themselves: the
        parameters of a `FusedMoEFactory` layer sit under `experts.<routed_experts_prefix>.`."""
        if num_redundant_experts:
            raise NotImplementedError("redundant experts (EPLB) are not supported")
        prefix = f"experts.{routed_experts_prefix}." if routed_experts_prefix else "experts."
        return build_expert_params_mapping(ckpt_gate_proj_name, ckpt_down_proj_name,
                                           ckpt_up_proj_name, num_experts, prefix)

    # ---- loading -------------------------------------------------------------------------------

    def _local_expert(self, expert_id: int) -> int:
        if self.expert_map is None:
            return expert_id
        return int(self.expert_map[expert_id])

    def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:
        return self._local_expert(expert_id)

    def update_expert_map(self) -> None:
        """The placement is fixed (no load balancer): nothing to recompute."""

    @property
    def moe_config(self) -> FusedMoEConfig:
        """This layer's sizes and split, as vLLM's model files read them."""
        parallel = FusedMoEParallelConfig(tp_size=self.tp_size, tp_rank=self.tp_rank,
                                          ep_size=self.ep_size, ep_rank=self.ep_rank)
        return FusedMoEConfig(self.global_num_experts, getattr(self, "top_k", 0),
                              self.hidden_size, self.intermediate_size_per_partition,
                              self.local_num_experts, parallel, self.activation, self.has_bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str,
                      shard_id: str, expert_id: int, return_success: bool = False) -> bool | None:
        """Copy one expert's gate (w1), up (w3) or down (w2) tensor, or its bias, into place:
        this rank's slice of the intermediate dimension; other ranks' experts are skipped."""
        if shard_id not in _SHARD_IDS:
            raise ValueError(f"shard_id must be one of {_SHARD_IDS}, got {shard_id!r}")
        if loaded_weight.dim() == param.dim() >= 2:
            # vLLM's "full load": consecutive experts at once [n, ...] from `expert_id` on
            # (Llama 4's fused checkpoints pass all of a rank's experts this way).
            done = [self.weight_loader(param, one, weight_name, shard_id, expert_id + i, True)
                    for i, one in enumerate(loaded_weight.unbind(0))]
            return all(done) if return_success else None
        local = self._local_expert(expert_id)
        if local < 0:
            return False if return_success else None
        i_p, is_bias = self.intermediate_size_per_partition, param.dim() == 2
        target = param.data[local]                      # [2I_p, H] / [H, I_p] / [2I_p] / [H]
        if shard_id == "w2":
            if not is_bias:                             # [H, I]: slice the input dimension
                loaded_weight = loaded_weight.narrow(1, self.tp_rank * i_p, i_p)
            elif self.tp_rank != 0:                     # the bias is added once, on rank 0
                loaded_weight = torch.zeros_like(loaded_weight)
        else:
            loaded_weight = loaded_weight.narrow(0, self.tp_rank * i_p, i_p)
            if not self.is_act_and_mul:                 # up rows only: shard "w1" fills all
                if shard_id == "w3":
                    raise ValueError(f"{weight_name}: non-gated experts ({self.activation!r}) "
                                     f"take shards 'w1' (up) and 'w2' (down), not 'w3'")
            elif self.activation == "swigluoai":      # gate and up rows alternate (gpt-oss's)
                target = target[0::2] if shard_id == "w1" else target[1::2]
            else:
                target = target[:i_p] if shard_id == "w1" else target[i_p:]
        if target.shape != loaded_weight.shape:
            raise ValueError(f"{weight_name}: expert {expert_id} shard {shard_id} has shape "
                             f"{tuple(loaded_weight.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded_weight)
        return True if return_success else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The stream under this layer: per-expert names ("3.gate_proj.weight", mapped by
        `expert_mapping`, or "3.gate_up_proj.weight") and stacked tensors ("gate_up_proj").
        A parameter counts as loaded once every local expert's shards arrived."""
        by_prefix = {weight_name[len("experts."):]: (param_name.rsplit(".", 1)[-1], expert, shard)
                     for param_name, weight_name, expert, shard in self.expert_mapping}
        params = dict(self.named_parameters(recurse=False))
        seen: dict[str, set[tuple[int, str]]] = {}
        unexpected = []
        for name, tensor in weights:
            pieces = self._split_checkpoint_tensor(name, tensor, by_prefix)
            if not pieces or any(p[0] not in params for p in pieces):
                unexpected.append(name)
                continue
            for param_name, piece, expert, shard in pieces:
                param = params[param_name]
                loader = getattr(param, "weight_loader", self.weight_loader)
                with torch.no_grad():
                    if loader(param, piece, name, shard, expert, return_success=True):
                        seen.setdefault(param_name, set()).add((self._local_expert(expert),
                                                                shard))
        w13_shards = 2 if self.is_act_and_mul else 1
        loaded = {name for name, got in seen.items()
                  if len(got) == self.local_num_experts * (1 if name.startswith("w2")
                                                           else w13_shards)}
        if unexpected:
            raise UnexpectedWeightsError(type(self).__name__, unexpected, loaded,
                                         {"": list(params)})
        return loaded

    def _split_checkpoint_tensor(self, name: str, tensor: torch.Tensor,
                                 by_prefix: dict) -> list[tuple[str, torch.Tensor, int, str]]:
        """One checkpoint tensor as (parameter, one expert's shard, expert id, shard id) pieces;
        [] when the name is not an expert weight of this layer."""
        head, _, suffix = name.rpartition(".")
        entry = by_prefix.get(head + ".")
        if entry is not None:                           # "3.gate_proj.weight"
            return [(entry[0] + suffix, tensor, entry[1], entry[2])]
        expert, _, fused = head.partition(".")
        if expert.isdigit() and fused in ("gate_up_proj", "w13"):   # "3.gate_up_proj.weight"
            gate, up = tensor.chunk(2, dim=0)
            param = f"w13_{suffix}"
            return [(param, gate, int(expert), "w1"), (param, up, int(expert), "w3")]
        stacked = _STACKED.get(name.removesuffix(".weight"))
        if stacked is None or tensor.shape[0] != self.global_num_experts:
            return []
        if self.is_fused_checkpoint_transposed and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)             # [E, H, 2I] -> [E, 2I, H]
        pieces = []
        for expert_id, one in enumerate(tensor.unbind(0)):
            if stacked.startswith("w2"):
                pieces.append((stacked, one, expert_id, "w2"))
            else:
                gate, up = one.chunk(2, dim=0)
                pieces += [(stacked, gate, expert_id, "w1"), (stacked, up, expert_id, "w3")]
        return pieces

    # ---- forward -------------------------------------------------------------------------------

    def forward_modular(self, x: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, shared_experts: object = None,
                        shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's routed output [T, H] (unreduced). `shared_experts` is the caller's to run."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, topk_weights, topk_ids)
        args = (x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.expert_map,
                self.w13_bias, self.w2_bias, self.activation, self.apply_router_weight_on_input)
        if torch.compiler.is_compiling():
            return torch.ops.minivllm.fused_experts(*args)
        return fused_experts_op(*args)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        return self.forward_modular(x, topk_weights, topk_ids)

    def maybe_all_reduce_tensor_model_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs (TP slices or EP experts) over the TP/EP group."""
        if self.tp_size > 1 or self.ep_size > 1:
            return get_ep_group().all_reduce(x)
        return x

    def extra_repr(self) -> str:
        return (f"global_num_experts={self.global_num_experts}, "
                f"local_num_experts={self.local_num_experts}, "
                f"hidden_size={self.hidden_size}, intermediate_size_per_partition="
                f"{self.intermediate_size_per_partition}, tp_size={self.tp_size}, "
                f"ep_size={self.ep_size}, activation={self.activation!r}")


def _moe_quant_method(layer: nn.Module, quant_config: object,
                      prefix: str) -> FusedMoEMethodBase | None:
    """The config's method for these experts, None to keep them plain (with a warning, once per
    config type, that they stay unquantized); a method that is not a FusedMoEMethodBase raises."""
    if quant_config is None:
        return None
    method = quant_config.get_quant_method(layer, prefix=prefix)
    if method is None:
        if type(quant_config) not in _WARNED:             # once per run, not per layer
            _WARNED.add(type(quant_config))
            logger.warning("MoE experts stay unquantized (%s covers only linear layers)",
                           type(quant_config).__name__)
        return None
    if not isinstance(method, FusedMoEMethodBase):
        raise NotImplementedError(f"quantized MoE experts ({type(quant_config).__name__}) "
                                  f"are not supported: {prefix}")
    return method
