"""Helpers every model file imports: prefixes, pipeline placeholders, layer lists, weight loading."""

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from minivllm.distributed import (get_pp_group, get_pp_indices, get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)
from minivllm.model_executor.models.auto_weights_loader import (AutoWeightsLoader,
                                                                UnexpectedWeightsError)
from minivllm.model_executor.models.placeholders import PPMissingLayer, StageMissingLayer
from minivllm.model_executor.models.weights_mapper import ShardId, WeightsMapper
from minivllm.sequence import IntermediateTensors

__all__ = [
    "AutoWeightsLoader", "PPMissingLayer", "ShardId", "ShardIds", "StageMissingLayer",
    "UnexpectedWeightsError", "WeightsMapper", "extract_layer_index", "fast_topk",
    "get_draft_quant_config", "get_pp_missing_layer_names", "process_eagle_weight",
    "is_pp_missing_parameter", "make_empty_intermediate_tensors_factory", "make_layers",
    "get_spec_layer_idx_from_weight_name", "maybe_fuse_shared_experts", "maybe_prefix",
    "no_init_weights", "sequence_parallel_chunk", "skip_spec_layers",
    "spec_decode_needs_target_embed",
]

# A stacked weight's shard, or a list of shards it is loaded into in turn (Gemma 4's k_proj
# filling both the K and the V shard of qkv_proj): the targets of `orig_to_new_stacked`.
ShardIds = ShardId | list[ShardId]

# Speculative methods whose drafter reads the target's embeddings on the last PP stage.
_EMBED_SHARING_SPEC_METHODS = ("eagle", "eagle3", "dflash", "dspark")


def maybe_prefix(prefix: str, name: str) -> str:
    """`name` at the root, else `prefix.name`."""
    return name if not prefix else f"{prefix}.{name}"


def make_layers(num_hidden_layers: int, layer_fn: Callable[..., nn.Module],
                prefix: str) -> tuple[int, int, nn.ModuleList]:
    """Build this stage's layers `[start, end)`; other slots hold PPMissingLayer.

    The list is full length so every layer keeps its global index and name on every stage.
    """
    pp = get_pp_group()
    start, end = get_pp_indices(num_hidden_layers, pp.rank_in_group, pp.world_size)
    layers = nn.ModuleList(
        [PPMissingLayer() for _ in range(start)]
        + [layer_fn(prefix=f"{prefix}.{idx}") for idx in range(start, end)]
        + [PPMissingLayer() for _ in range(end, num_hidden_layers)])
    return start, end, layers


def make_empty_intermediate_tensors_factory(keys: list[str], hidden_size: int):
    """A function `(batch_size, dtype, device) -> IntermediateTensors` of zeros `[batch, hidden]`."""

    def make_empty_intermediate_tensors(batch_size: int, dtype: torch.dtype,
                                        device: torch.device | str) -> IntermediateTensors:
        return IntermediateTensors({key: torch.zeros((batch_size, hidden_size), dtype=dtype, device=device)
                                    for key in keys})

    return make_empty_intermediate_tensors


def extract_layer_index(layer_name: str, num_attn_module: int = 1) -> int:
    """The layer number in a dotted name, e.g. `model.layers.3.self_attn.attn` -> 3."""
    int_vals = [int(part) for part in layer_name.split(".") if part.lstrip("-").isdigit()]
    if num_attn_module == 1 or "attn" not in layer_name:
        assert len(int_vals) == 1, f"layer name {layer_name} should only contain one integer"
        return int_vals[0]
    # Several attention modules per layer: the second integer selects the module.
    assert len(int_vals) <= 2, f"layer name {layer_name} should contain at most two integers"
    return int_vals[0] * num_attn_module + int_vals[1] if len(int_vals) == 2 else int_vals[0]


def fast_topk(values: torch.Tensor, topk: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(values, topk, dim)` as (values, indices); k = 1 (Llama 4's router) takes
    `max`, which keeps the dim and is cheaper than a sort-based top-k."""
    if topk == 1:
        return torch.max(values, dim=dim, keepdim=True)
    return torch.topk(values, topk, dim=dim)


def sequence_parallel_chunk(x: torch.Tensor) -> torch.Tensor:
    """This TP rank's share of the tokens, for sequence-parallel MoE: x [T, ...] padded with zero
    rows to a multiple of the TP size, then rank r's [ceil(T / tp), ...] block."""
    tp_size = get_tensor_model_parallel_world_size()
    if tp_size == 1:
        return x
    chunk = -(-x.shape[0] // tp_size)
    pad = chunk * tp_size - x.shape[0]
    if pad:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
    return x.narrow(0, get_tensor_model_parallel_rank() * chunk, chunk)


def get_spec_layer_idx_from_weight_name(config: Any, weight_name: str) -> int | None:
    """The index of the multi-token-prediction layer a checkpoint weight belongs to, or None:
    MTP layers follow the `num_hidden_layers` decoder layers (`num_nextn_predict_layers` of
    them, DeepSeek / GLM-4 MoE checkpoints)."""
    base = config.num_hidden_layers
    for idx in range(base, base + (getattr(config, "num_nextn_predict_layers", 0) or 0)):
        if weight_name.startswith((f"model.layers.{idx}.", f"layers.{idx}.",
                                   f"model.language_model.layers.{idx}.")):
            return idx
    return None


def skip_spec_layers(weights: Iterator[tuple[str, torch.Tensor]], config: Any
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream without its MTP-layer weights (the base model has no such layers;
    minivllm runs no MTP drafter)."""
    return ((name, w) for name, w in weights
            if get_spec_layer_idx_from_weight_name(config, name) is None)


def maybe_fuse_shared_experts(weights: Iterator[tuple[str, torch.Tensor]], *,
                              n_routed_experts: int, n_shared_experts: int,
                              ckpt_prefix: str = "mlp.shared_experts",
                              enabled: bool | None = None
                              ) -> Iterator[tuple[str, torch.Tensor]]:
    """vLLM renames shared-expert weights into extra routed-expert slots when AITER fuses them;
    minivllm never fuses (`fused_moe.utils`), so the stream passes through unchanged."""
    if enabled:
        raise NotImplementedError("fused shared experts (ROCm AITER) are not supported")
    return weights


# Weak keys: a freed model must not leave its names behind for a new model at the same id().
_PP_MISSING_NAMES: "weakref.WeakKeyDictionary[nn.Module, list[str]]" = weakref.WeakKeyDictionary()


def get_pp_missing_layer_names(model: nn.Module) -> list[str]:
    """Qualified names (with a trailing dot) of every placeholder module; cached per model."""
    if model not in _PP_MISSING_NAMES:
        _PP_MISSING_NAMES[model] = [f"{name}." for name, module in model.named_modules()
                                    if isinstance(module, (PPMissingLayer, StageMissingLayer))]
    return _PP_MISSING_NAMES[model]


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """True when `name` belongs to a module that this pipeline stage does not hold."""
    return any(name.startswith(prefix) for prefix in get_pp_missing_layer_names(model))


def spec_decode_needs_target_embed(vllm_config: Any, *, include_mtp: bool = False) -> bool:
    """The last PP stage also builds `embed_tokens` when an EAGLE-style drafter shares it."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    methods = _EMBED_SHARING_SPEC_METHODS + (("mtp",) if include_mtp else ())
    if getattr(spec, "method", None) not in methods:
        return False
    pp = get_pp_group()
    return pp.world_size > 1 and pp.is_last_rank


def get_draft_quant_config(vllm_config: Any) -> Any:
    """The quantization config of the speculative draft's own checkpoint (an EAGLE head builds
    its layers with it, not with the target's); None when it has none. EngineArgs reads it
    from the draft's checkpoint beside the draft's ModelConfig."""
    spec = vllm_config.speculative_config
    return None if spec is None else spec.draft_quant_config


def process_eagle_weight(model: nn.Module, name: str) -> None:
    """Notes, while an EAGLE head loads, that its checkpoint has its own LM head or embedding
    (otherwise the proposer gives it the target's)."""
    if "lm_head" in name:
        model.has_own_lm_head = True
    if "embed_tokens" in name:
        model.has_own_embed_tokens = True


@contextlib.contextmanager
def no_init_weights(model: nn.Module, placeholder: Callable[[nn.Module], nn.Module], *,
                    targets: tuple[str, ...]) -> Iterator[None]:
    """Build `model` inside this context; on exit every submodule whose class (or a base) is named
    in `targets` is swapped for `placeholder(module)`.

    The replaced modules' own parameters move to the meta device to free their memory, except
    parameters still shared with the kept model (a tied LM head shares the embedding's weight).
    """
    yield
    replaced: list[nn.Module] = []
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if _class_named(child, targets):
                setattr(parent, attr, placeholder(child))
                replaced.append(child)
    kept = {id(p) for p in model.parameters()}
    for module in replaced:
        for sub in module.modules():
            for pname, param in list(sub._parameters.items()):
                if param is not None and id(param) not in kept:
                    sub._parameters[pname] = nn.Parameter(param.to("meta"), requires_grad=False)


def _class_named(module: nn.Module, names: tuple[str, ...]) -> bool:
    # By name, so the check needs no import of the layer modules (they import this file).
    return any(cls.__name__ in names for cls in type(module).__mro__)
