"""Building MoE layers: vLLM 0.33's `FusedMoEFactory` (-> `MoERunner`) and the older `FusedMoE`.

Both put the same pieces together: a `FusedMoERouter` (top-k routing) and the `RoutedExperts`
(weights, loading, TP / EP sharding, the expert kernels). They differ in where the weights sit
and who adds the shared experts:
- `FusedMoEFactory(...)` returns a `MoERunner` whose experts are its `routed_experts` child
  (`experts.routed_experts.w13_weight`); it may hold the gate and the shared experts, and sums
  everything over the TP / EP group itself. vLLM 0.33's model files use it.
- `FusedMoE(...)` *is* the routed experts (`experts.w13_weight`), routes in `forward`, and with
  `shared_experts` returns `(shared_output, routed_output)` for the model to add. Older vLLM model
  files and minivllm's own use it.
Features neither provides (load balancing, sequence- or data-parallel MoE, fused shared experts,
hashed experts, custom runner classes) raise, naming the argument. Zero experts
(`zero_expert_type`, LongCat-Flash's) are the factory's alone.
"""

from collections.abc import Callable

import torch
from torch import nn

from minivllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter
from minivllm.model_executor.layers.fused_moe.router.zero_expert_router import ZeroExpertRouter
from minivllm.model_executor.layers.fused_moe.routed_experts import (ExpertMapping,
                                                                     RoutedExperts,
                                                                     build_expert_params_mapping)
from minivllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

# FusedMoEFactory arguments that only steer GPU kernels or bookkeeping with no effect here
# (`shared_expert_prefix` names the shared experts only when they are fused, which is refused).
# NOTE: custom `runner_cls` / `moe_config_cls` are refused (in `unsupported`): their vLLM
# counterparts drive GPU kernel pipelines minivllm does not have.
_KERNEL_ONLY = ("router_logits_dtype", "skip_padding", "intermediate_pad", "shared_expert_prefix")


# NOTE: a function with a class-style name, as in vLLM (model files call it like a class).
def FusedMoEFactory(num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,  # noqa: N802
                    params_dtype: torch.dtype | None = None, renormalize: bool = True,
                    use_grouped_topk: bool = False, num_expert_group: int | None = None,
                    topk_group: int | None = None, quant_config: object = None,
                    tp_size: int | None = None, dp_size: int | None = None,
                    pcp_size: int | None = None, prefix: str = "",
                    custom_routing_function: Callable | None = None,
                    router: FusedMoERouter | None = None, scoring_func: str = "softmax",
                    routed_scaling_factor: float = 1.0,
                    e_score_correction_bias: torch.Tensor | None = None,
                    apply_router_weight_on_input: bool = False, activation: str = "silu",
                    enable_eplb: bool = False, num_redundant_experts: int = 0,
                    has_bias: bool = False, is_sequence_parallel: bool = False,
                    reduce_results: bool = True,
                    ckpt_names: tuple[str, str, str | None] = ("gate_proj", "down_proj",
                                                               "up_proj"),
                    is_fused_checkpoint_transposed: bool = False,
                    gate: nn.Module | None = None, shared_experts: nn.Module | None = None,
                    shared_expert_gate: nn.Module | None = None,
                    routed_input_transform: nn.Module | None = None,
                    routed_output_transform: nn.Module | None = None,
                    apply_routed_scale_to_output: bool = False,
                    routed_experts_cls: type[RoutedExperts] | None = None,
                    routed_experts_args: dict | None = None,
                    n_shared_experts: int | None = None,
                    zero_expert_type: str | None = None,
                    **unsupported: object) -> MoERunner:
    """A `MoERunner`: router, routed experts (at `.routed_experts`, named `prefix`) and the
    model's gate / shared experts, with vLLM 0.33's arguments. `routed_experts_cls` may be a
    model's RoutedExperts subclass (its own weight loading), built with the same arguments.
    `n_shared_experts` counts shared experts to fuse into the routed GEMM, which vLLM does only
    with `fuse_shared_experts` (refused here): the `shared_experts` module runs them instead."""
    unsupported = {k: v for k, v in unsupported.items() if k not in _KERNEL_ONLY}
    _check_arguments(top_k, apply_router_weight_on_input, enable_eplb, num_redundant_experts,
                     is_sequence_parallel, dp_size, pcp_size, unsupported)
    if zero_expert_type is not None:
        # LongCat-Flash: the logits and the bias also cover weightless zero experts; their
        # output joins after the reduction, so the runner must reduce (as vLLM forces it).
        if router is not None or use_grouped_topk or custom_routing_function is not None:
            raise NotImplementedError("zero experts take FusedMoEFactory's own plain top-k "
                                      "router (no router, use_grouped_topk or "
                                      "custom_routing_function)")
        router = ZeroExpertRouter(
            top_k, num_experts, e_score_correction_bias, num_experts, zero_expert_type,
            scoring_func, renormalize,
            1.0 if apply_routed_scale_to_output else routed_scaling_factor)
        reduce_results = True
    if router is None:
        router = FusedMoERouter(
            top_k, num_experts, renormalize, use_grouped_topk, num_expert_group, topk_group,
            custom_routing_function, scoring_func,
            1.0 if apply_routed_scale_to_output else routed_scaling_factor,
            e_score_correction_bias)
    experts_cls = routed_experts_cls or RoutedExperts
    if not issubclass(experts_cls, RoutedExperts):
        raise TypeError(f"routed_experts_cls must subclass RoutedExperts, got {experts_cls}")
    experts = experts_cls(
        prefix, params_dtype, num_experts=num_experts, hidden_size=hidden_size,
        intermediate_size=intermediate_size, quant_config=quant_config, tp_size=tp_size,
        activation=activation, has_bias=has_bias,
        apply_router_weight_on_input=apply_router_weight_on_input, ckpt_names=ckpt_names,
        is_fused_checkpoint_transposed=is_fused_checkpoint_transposed,
        **(routed_experts_args or {}))
    experts.top_k = top_k
    if isinstance(e_score_correction_bias, nn.Parameter):
        # As vLLM's RoutedExperts: the experts hold the routing bias, so a model file may pass
        # one no module of its own holds and have it loaded from "<prefix>.e_score_correction_bias"
        # (a gate-held one keeps the gate's name: named_parameters reports it once, there).
        experts.e_score_correction_bias = e_score_correction_bias
    return MoERunner(prefix, router, experts, gate=gate, shared_experts=shared_experts,
                     shared_expert_gate=shared_expert_gate,
                     routed_input_transform=routed_input_transform,
                     routed_output_transform=routed_output_transform,
                     routed_scaling_factor=(routed_scaling_factor if apply_routed_scale_to_output
                                            else 1.0),
                     reduce_results=reduce_results)


def fused_moe_make_expert_params_mapping(model: nn.Module | None, ckpt_gate_proj_name: str,
                                         ckpt_down_proj_name: str,
                                         ckpt_up_proj_name: str | None, num_experts: int,
                                         num_redundant_experts: int = 0,
                                         routed_experts_prefix: str = "routed_experts"
                                         ) -> ExpertMapping:
    """vLLM 0.33's expert mapping for a `FusedMoEFactory` layer: ("experts.routed_experts.w13_",
    "experts.3.gate_proj.", 3, "w1"), ..."""
    return RoutedExperts.make_expert_params_mapping(
        model, ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name, num_experts,
        num_redundant_experts, routed_experts_prefix)


class FusedMoE(RoutedExperts):
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
        _check_arguments(top_k, apply_router_weight_on_input, enable_eplb, num_redundant_experts,
                         is_sequence_parallel, dp_size, None, unsupported)
        # Built before the module: nn.Module attributes can only be set after its __init__.
        router = FusedMoERouter(top_k, num_experts, renormalize, use_grouped_topk,
                                num_expert_group, topk_group, custom_routing_function,
                                scoring_func, routed_scaling_factor, e_score_correction_bias)
        super().__init__(prefix, params_dtype, num_experts=num_experts, hidden_size=hidden_size,
                         intermediate_size=intermediate_size, quant_config=quant_config,
                         tp_size=tp_size, ep_size=ep_size, activation=activation,
                         has_bias=has_bias,
                         apply_router_weight_on_input=apply_router_weight_on_input,
                         expert_mapping=expert_mapping)
        self.router = router
        self.top_k, self.reduce_results = top_k, reduce_results
        # Held outside the module tree: the model owns them (and their prefixes) already.
        self._outside = (shared_experts, gate)

    # The routing settings, read where vLLM's FusedMoE kept them.
    renormalize = property(lambda self: self.router.renormalize)
    scoring_func = property(lambda self: self.router.scoring_func)
    routed_scaling_factor = property(lambda self: self.router.routed_scaling_factor)
    e_score_correction_bias = property(lambda self: self.router.e_score_correction_bias)
    use_grouped_topk = property(lambda self: self.router.use_grouped_topk)

    @property
    def shared_experts(self) -> nn.Module | None:
        return self._outside[0]

    @property
    def gate(self) -> nn.Module | None:
        return self._outside[1]

    @classmethod
    def make_expert_params_mapping(cls, model: nn.Module | str | None, ckpt_gate_proj_name: str,
                                   ckpt_down_proj_name: str, ckpt_up_proj_name: str | int,
                                   num_experts: int | None = None,
                                   num_redundant_experts: int = 0) -> ExpertMapping:
        """The mapping for a FusedMoE's own parameters ("experts.w13_", "experts.3.gate_proj.",
        3, "w1"). `model` (vLLM 0.33's first argument) is unused; the older call without it is
        accepted."""
        if isinstance(model, str):      # the pre-0.33 form: (gate, down, up, num_experts)
            model, ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name, num_experts = (
                None, model, ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name)
        if num_redundant_experts:
            raise NotImplementedError("redundant experts (EPLB) are not supported")
        return build_expert_params_mapping(ckpt_gate_proj_name, ckpt_down_proj_name,
                                           ckpt_up_proj_name, int(num_experts))

    def select_experts(self, hidden_states: torch.Tensor,
                       router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32, topk_ids [T, k] global ids), routed_scaling_factor applied."""
        return self.router.select_experts(hidden_states, router_logits)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.forward_native(hidden_states, router_logits)

    def forward_native(self, hidden_states: torch.Tensor, router_logits: torch.Tensor
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
        weights, ids = self.router.select_experts(hidden_states, router_logits)
        routed = self.forward_modular(hidden_states, weights, ids)
        if self.reduce_results:
            routed = self.maybe_all_reduce_tensor_model_parallel(routed)
            if shared is not None:
                shared = self.maybe_all_reduce_tensor_model_parallel(shared)
        return routed if shared is None else (shared, routed)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, top_k={self.top_k}, "
                f"scoring_func={self.scoring_func!r}")


def _check_arguments(top_k: int, apply_router_weight_on_input: bool, enable_eplb: bool,
                     num_redundant_experts: int, is_sequence_parallel: bool, dp_size: int | None,
                     pcp_size: int | None, unsupported: dict[str, object]) -> None:
    """Both constructors' argument checks: features minivllm's MoE does not provide raise,
    naming the feature."""
    if apply_router_weight_on_input and top_k != 1:
        raise ValueError("apply_router_weight_on_input needs top_k == 1")
    if enable_eplb or num_redundant_experts:
        raise NotImplementedError("expert load balancing (EPLB) is not supported")
    if is_sequence_parallel or (dp_size or 1) > 1 or (pcp_size or 1) > 1:
        raise NotImplementedError("sequence-, data- and context-parallel MoE are not supported")
    given = sorted(k for k, v in unsupported.items() if v not in (None, False, 0))
    if given:
        raise NotImplementedError(f"MoE arguments not supported: {given}")
