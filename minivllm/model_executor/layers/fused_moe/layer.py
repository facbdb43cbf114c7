"""`FusedMoE`: the routed experts of a MoE block, sharded by tensor or expert parallelism.

Parameters (vLLM's layout): `w13_weight [E_local, 2 * I_p, H]` (each expert's gate rows, then
its up rows) and `w2_weight [E_local, H, I_p]`, optional `w13_bias [E_local, 2 * I_p]` and
`w2_bias [E_local, H]`. Checkpoint tensors arrive one expert and one shard at a time through
`weight_loader(param, w, weight_name, shard_id, expert_id)`, `shard_id` "w1" (gate), "w3" (up)
or "w2" (down); `make_expert_params_mapping` names them.

Sharding, T = TP size (data parallel size is 1):
- tensor parallel (default): every rank holds all E experts, each sliced to I_p = I / T of its
  intermediate dimension; the partial outputs are summed over the TP group;
- expert parallel (`ParallelConfig.enable_expert_parallel`, `--enable-expert-parallel`): the EP
  group (`get_ep_group`, the TP group's ranks) splits the experts into contiguous runs, rank r
  holding whole experts (I_p = I); every rank routes all tokens, runs its own experts and the
  outputs are summed over the group.
Either way the sum is `maybe_all_reduce_tensor_model_parallel` (done in `forward` when
`reduce_results`).
"""

from collections.abc import Callable, Iterable

import torch
from torch import nn

from minivllm.config import get_current_vllm_config
from minivllm.logger import init_logger
from minivllm.distributed import (get_ep_group, get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)
from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.layers.fused_moe.cpu_fused_moe import moe_topk
from minivllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from minivllm.model_executor.layers.fused_moe.fused_moe import (ACTIVATIONS, SCORING_FUNCS,
                                                                fused_experts_op, fused_topk,
                                                                grouped_topk)
from minivllm.model_executor.models.auto_weights_loader import UnexpectedWeightsError
from minivllm.model_executor.parameter import set_weight_attrs

logger = init_logger(__name__)
_WARNED: set[type] = set()

ExpertMapping = list[tuple[str, str, int, str]]
_SHARD_IDS = ("w1", "w2", "w3")


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


@CustomOp.register("fused_moe")
class FusedMoE(CustomOp):
    """Top-k routing plus the experts: `forward(hidden_states [T, H], router_logits [T, E])`.

    Returns [T, H]; with `shared_experts` (an nn.Module run on the same input) it returns
    `(shared_output, routed_output)` as vLLM's SharedFusedMoE does, the model adding the two.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 params_dtype: torch.dtype | None = None, reduce_results: bool = False,
                 renormalize: bool = True, use_grouped_topk: bool = False,
                 num_expert_group: int | None = None, topk_group: int | None = None,
                 quant_config: object = None, tp_size: int | None = None,
                 ep_size: int | None = None, dp_size: int | None = None, prefix: str = "",
                 custom_routing_function: Callable | None = None, scoring_func: str = "softmax",
                 routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: torch.Tensor | None = None,
                 apply_router_weight_on_input: bool = False, activation: str = "silu",
                 enable_eplb: bool = False, num_redundant_experts: int = 0,
                 has_bias: bool = False, is_sequence_parallel: bool = False,
                 expert_mapping: ExpertMapping | None = None,
                 shared_experts: nn.Module | None = None, gate: nn.Module | None = None,
                 **unsupported: object) -> None:
        super().__init__()
        _refuse_unsupported(enable_eplb, num_redundant_experts, is_sequence_parallel, dp_size,
                            unsupported)
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"Unsupported scoring function {scoring_func!r}; choose one of "
                             f"{', '.join(SCORING_FUNCS)}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"Unsupported MoE activation {activation!r}; choose one of "
                             f"{', '.join(ACTIVATIONS)}")
        if apply_router_weight_on_input and top_k != 1:
            raise ValueError("apply_router_weight_on_input needs top_k == 1")
        self.prefix = prefix
        self.global_num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.reduce_results, self.renormalize = reduce_results, renormalize
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.custom_routing_function, self.scoring_func = custom_routing_function, scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        self.e_score_correction_bias = e_score_correction_bias
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.activation = activation
        self.has_bias = has_bias
        # Held outside the module tree: the model owns them (and their prefixes) already.
        self._outside = (shared_experts, gate)
        self._init_parallel(tp_size, ep_size)
        self.expert_mapping = expert_mapping or self.make_expert_params_mapping(
            None, "gate_proj", "down_proj", "up_proj", num_experts)
        self.quant_method = _moe_quant_method(self, quant_config, prefix)
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
        shapes = {"w13_weight": (e, 2 * i, h), "w2_weight": (e, h, i)}
        if self.has_bias:
            shapes |= {"w13_bias": (e, 2 * i), "w2_bias": (e, h)}
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(param, {"weight_loader": self.weight_loader})
            self.register_parameter(name, param)
        if not self.has_bias:
            self.w13_bias = self.w2_bias = None

    @property
    def shared_experts(self) -> nn.Module | None:
        return self._outside[0]

    @property
    def gate(self) -> nn.Module | None:
        return self._outside[1]

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def make_expert_params_mapping(cls, model: nn.Module | str | None, ckpt_gate_proj_name: str,
                                   ckpt_down_proj_name: str, ckpt_up_proj_name: str | int,
                                   num_experts: int | None = None,
                                   num_redundant_experts: int = 0) -> ExpertMapping:
        """[(param_name, weight_name, expert_id, shard_id)], e.g.
        ("experts.w13_", "experts.3.gate_proj.", 3, "w1"): a checkpoint name containing
        `weight_name` loads into `param_name + <rest>` ("weight" / "bias").

        `model` (vLLM 0.33's first argument) is unused; the older call without it is accepted.
        """
        if isinstance(model, str):      # the pre-0.33 form: (gate, down, up, num_experts)
            model, ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name, num_experts = (
                None, model, ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name)
        if num_redundant_experts:
            raise NotImplementedError("redundant experts (EPLB) are not supported")
        shards = [("w1", ckpt_gate_proj_name), ("w2", ckpt_down_proj_name),
                  ("w3", ckpt_up_proj_name)]
        return [("experts.w13_" if shard_id != "w2" else "experts.w2_",
                 f"experts.{expert_id}.{weight_name}.", expert_id, shard_id)
                for expert_id in range(int(num_experts)) for shard_id, weight_name in shards]

    def _local_expert(self, expert_id: int) -> int:
        if self.expert_map is None:
            return expert_id
        return int(self.expert_map[expert_id])

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str,
                      shard_id: str, expert_id: int, return_success: bool = False) -> bool | None:
        """Copy one expert's gate (w1), up (w3) or down (w2) tensor, or its bias, into place:
        this rank's slice of the intermediate dimension; other ranks' experts are skipped."""
        if shard_id not in _SHARD_IDS:
            raise ValueError(f"shard_id must be one of {_SHARD_IDS}, got {shard_id!r}")
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
            target = target[:i_p] if shard_id == "w1" else target[i_p:]
        if target.shape != loaded_weight.shape:
            raise ValueError(f"{weight_name}: expert {expert_id} shard {shard_id} has shape "
                             f"{tuple(loaded_weight.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded_weight)
        return True if return_success else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The stream under this layer ("3.gate_proj.weight", ...), mapped by `expert_mapping`;
        a parameter counts as loaded once every local expert's shards arrived."""
        by_prefix = {weight_name[len("experts."):]: (param_name[len("experts."):], expert, shard)
                     for param_name, weight_name, expert, shard in self.expert_mapping}
        params = dict(self.named_parameters(recurse=False))
        seen: dict[str, set[tuple[int, str]]] = {}
        unexpected = []
        for name, tensor in weights:
            head, _, suffix = name.rpartition(".")
            entry = by_prefix.get(head + ".")
            param_name = entry[0] + suffix if entry is not None else None
            if param_name not in params:
                unexpected.append(name)
                continue
            _, expert, shard = entry
            with torch.no_grad():
                param = params[param_name]
                loader = getattr(param, "weight_loader", self.weight_loader)
                if loader(param, tensor, name, shard, expert,
                                      return_success=True):
                    seen.setdefault(param_name, set()).add((self._local_expert(expert), shard))
        loaded = {name for name, pieces in seen.items()
                  if len(pieces) == self.local_num_experts * (1 if name.startswith("w2") else 2)}
        if unexpected:
            raise UnexpectedWeightsError(type(self).__name__, unexpected, loaded,
                                         {"": list(params)})
        return loaded

    # ---- forward -------------------------------------------------------------------------------

    def select_experts(self, hidden_states: torch.Tensor,
                       router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32, topk_ids [T, k] global ids), routed_scaling_factor applied."""
        if self.use_grouped_topk:
            return grouped_topk(
                hidden_states, router_logits, self.top_k, self.renormalize,
                self.num_expert_group or 0, self.topk_group or 0, self.scoring_func,
                self.routed_scaling_factor, self.e_score_correction_bias)
        native = None
        # bf16 only: fp32 models keep torch's routing bit for bit (their experts stay in torch).
        # Compiled graphs take torch's routing (a ctypes call would break the graph).
        if (self.custom_routing_function is None and self.e_score_correction_bias is None
                and not torch.compiler.is_compiling()
                and router_logits.dtype == torch.bfloat16):
            native = moe_topk(router_logits, self.top_k, self.renormalize, self.scoring_func,
                              self.routed_scaling_factor)
        if native is not None:                          # routing in C (a CPU graph records it)
            return native
        if self.custom_routing_function is not None:
            weights, ids = self.custom_routing_function(hidden_states, router_logits,
                                                        self.top_k, self.renormalize)
            weights, ids = weights.float(), ids.long()
        else:
            weights, ids, _ = fused_topk(
                hidden_states, router_logits, self.top_k, self.renormalize,
                scoring_func=self.scoring_func,
                e_score_correction_bias=self.e_score_correction_bias)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights, ids

    def forward_native(self, hidden_states: torch.Tensor, router_logits: torch.Tensor
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
        weights, ids = self.select_experts(hidden_states, router_logits)
        if self.quant_method is not None:
            routed = self.quant_method.apply(self, hidden_states, weights, ids)
            return self._finish(routed, shared)
        args = (hidden_states, self.w13_weight, self.w2_weight, weights, ids, self.expert_map,
                self.w13_bias, self.w2_bias, self.activation, self.apply_router_weight_on_input)
        if torch.compiler.is_compiling():
            routed = torch.ops.minivllm.fused_experts(*args)
        else:
            routed = fused_experts_op(*args)
        return self._finish(routed, shared)

    def _finish(self, routed: torch.Tensor, shared: torch.Tensor | None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.reduce_results:
            routed = self.maybe_all_reduce_tensor_model_parallel(routed)
            if shared is not None:
                shared = self.maybe_all_reduce_tensor_model_parallel(shared)
        return routed if shared is None else (shared, routed)

    def maybe_all_reduce_tensor_model_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs (TP slices or EP experts) over the TP/EP group."""
        if self.tp_size > 1 or self.ep_size > 1:
            return get_ep_group().all_reduce(x)
        return x

    def extra_repr(self) -> str:
        return (f"global_num_experts={self.global_num_experts}, "
                f"local_num_experts={self.local_num_experts}, top_k={self.top_k}, "
                f"hidden_size={self.hidden_size}, intermediate_size_per_partition="
                f"{self.intermediate_size_per_partition}, tp_size={self.tp_size}, "
                f"ep_size={self.ep_size}, scoring_func={self.scoring_func!r}, "
                f"activation={self.activation!r}")


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


def _refuse_unsupported(enable_eplb: bool, num_redundant_experts: int,
                        is_sequence_parallel: bool, dp_size: int | None,
                        unsupported: dict[str, object]) -> None:
    """Features this FusedMoE does not provide raise here, naming the feature."""
    if enable_eplb or num_redundant_experts:
        raise NotImplementedError("expert load balancing (EPLB) is not supported")
    if is_sequence_parallel or (dp_size or 1) > 1:
        raise NotImplementedError("sequence- and data-parallel MoE are not supported")
    given = sorted(k for k, v in unsupported.items() if v not in (None, False, 0))
    if given:
        raise NotImplementedError(f"FusedMoE arguments not supported: {given}")
