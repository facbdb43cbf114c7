"""`MoERunner` (vLLM 0.33): one MoE layer's forward, as `FusedMoEFactory` assembles it.

    hidden [T, H] --gate?--> router logits [T, E] --router--> (topk_weights, topk_ids) [T, k]
        --routed_experts--> routed [T, H] (this rank's part) * routed_scaling_factor?
        + shared experts(hidden)?   --sum over the TP / EP group (unless reduce_results=False)

The gate and the shared experts are modules the model file built (and registered first, under
their own prefixes); the runner holds them too, so its parameter names repeat theirs, and
`named_parameters()` reports each once, under the model's name. Checkpoint names under the
runner ("3.gate_proj.weight", "gate_up_proj") go to `routed_experts` through `load_weights`.
"""

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.model_executor.custom_op import PluggableLayer
from minivllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter
from minivllm.model_executor.layers.fused_moe.router.zero_expert_router import ZeroExpertRouter
from minivllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

# A routing bias the factory was handed as a free Parameter: held by the routed experts.
_ROUTING_BIAS = "e_score_correction_bias"


class SharedExperts(nn.Module):
    """The model's shared-expert module (`_layer`), run on the same input as the routed ones."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self._layer = layer

    def forward(self, shared_experts_input: torch.Tensor) -> torch.Tensor:
        out = self._layer(shared_experts_input)
        return out[0] if isinstance(out, tuple) else out


class MoERunner(PluggableLayer):
    """`forward(hidden_states [T, H], router_logits [T, E])` -> [T, H], shared experts added."""

    # The routed experts are named like the runner (`prefix`): quantization configs and
    # checkpoints know them as "<block>.experts", never "<block>.experts.routed_experts".
    prefix_shared_children = ("routed_experts",)

    def __init__(self, layer_name: str, router: FusedMoERouter, routed_experts: RoutedExperts,
                 gate: nn.Module | None = None, shared_experts: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None,
                 routed_input_transform: nn.Module | None = None,
                 routed_output_transform: nn.Module | None = None,
                 routed_scaling_factor: float = 1.0, reduce_results: bool = True) -> None:
        super().__init__()
        # NOTE: `prefix`, not vLLM's `layer_name`: minivllm marks attention layers by the latter.
        self.prefix = layer_name
        self.router = router
        self.gate = gate
        # vLLM fuses this gate into the router GEMM on some GPUs; the shared-expert module
        # applies it itself (Qwen2-MoE's `expert_gate`), so here it is only held.
        self.shared_expert_gate = shared_expert_gate
        self.routed_input_transform = routed_input_transform
        self.routed_output_transform = routed_output_transform
        self.routed_experts = routed_experts
        self._shared_experts = SharedExperts(shared_experts) if shared_experts is not None else None
        # Applied to the routed output (vLLM's `apply_routed_scale_to_output`); otherwise the
        # router already scaled the top-k weights and this is 1.
        self.routed_scaling_factor = routed_scaling_factor
        self.reduce_results = reduce_results

    @property
    def shared_experts(self) -> SharedExperts | None:
        return self._shared_experts

    # The attributes model files reach through `self.experts`, answered by the routed experts.
    @property
    def expert_map(self) -> torch.Tensor | None:
        return self.routed_experts.expert_map

    @property
    def _quant_method(self) -> object:
        return self.routed_experts.quant_method

    @property
    def moe_config(self) -> object:
        return self.routed_experts.moe_config

    @property
    def use_ep(self) -> bool:
        return self.routed_experts.use_ep

    @property
    def e_score_correction_bias(self) -> torch.Tensor | None:
        return self.router.e_score_correction_bias

    def update_expert_map(self) -> None:
        self.routed_experts.update_expert_map()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Names under the runner are the routed experts' (reported as "routed_experts.*").
        "e_score_correction_bias" [E] is the routing bias a model file handed the factory as a
        Parameter of no module of its own (vLLM's laguna.py): the routed experts hold it."""
        loaded: set[str] = set()

        def expert_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                bias = getattr(self.routed_experts, name, None) if name == _ROUTING_BIAS else None
                if not isinstance(bias, nn.Parameter):
                    yield name, tensor
                elif bias.shape != tensor.shape:
                    raise ValueError(f"{self.prefix}.{name}: checkpoint shape "
                                     f"{tuple(tensor.shape)}, expected {tuple(bias.shape)}")
                else:
                    with torch.no_grad():
                        bias.copy_(tensor)
                    loaded.add(name)
        loaded |= set(self.routed_experts.load_weights(expert_weights()))
        return {f"routed_experts.{name}" for name in loaded}

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                input_ids: torch.Tensor | None = None,
                shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        if shared_experts_input is None:
            shared_experts_input = hidden_states
            if self.routed_input_transform is not None:     # e.g. a latent down-projection
                hidden_states = _first(self.routed_input_transform(hidden_states))
        if self.gate is not None:                           # the runner holds the gate
            router_logits = _first(self.gate(hidden_states))
        topk_weights, topk_ids = self.router.select_experts(hidden_states, router_logits)
        routed = self.routed_experts.forward_modular(hidden_states, topk_weights, topk_ids)
        if self.routed_output_transform is not None:
            # A non-linear transform needs the full routed sum first.
            routed = self.routed_experts.maybe_all_reduce_tensor_model_parallel(routed)
            routed = _first(self.routed_output_transform(routed))
            reduced = True
        else:
            reduced = False
        if self.routed_scaling_factor != 1.0:
            routed = routed * self.routed_scaling_factor
        if self._shared_experts is not None:
            shared = self._shared_experts(shared_experts_input)
            if reduced:
                shared = self.routed_experts.maybe_all_reduce_tensor_model_parallel(shared)
            routed = routed + shared
        if self.reduce_results and not reduced:
            routed = self.routed_experts.maybe_all_reduce_tensor_model_parallel(routed)
        if isinstance(self.router, ZeroExpertRouter):   # weightless experts: once, not per rank
            routed = routed + self.router.zero_expert_output
        return routed

    def extra_repr(self) -> str:
        return (f"prefix={self.prefix!r}, top_k={self.router.top_k}, "
                f"scoring_func={self.router.scoring_func!r}, reduce_results={self.reduce_results}")


def _first(out: torch.Tensor | tuple) -> torch.Tensor:
    """A linear layer's output without its bias slot."""
    return out[0] if isinstance(out, tuple) else out
