"""Capability interfaces a model class declares by inheriting them, and their detection helpers."""

from collections.abc import Iterable
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from minivllm.config import VllmConfig
from minivllm.distributed import get_pp_group, model_parallel_is_initialized
from minivllm.logger import init_logger
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.models.interfaces_base import (is_pooling_model, is_vllm_model,
                                                            supports_kw)
from minivllm.sequence import IntermediateTensors

logger = init_logger(__name__)

__all__ = [
    "EagleModelMixin", "HasInnerState", "IsAttentionFree", "IsHybrid", "LocalArgmaxMixin",
    "MixtureOfExperts", "SupportsCrossEncoding", "SupportsEagle",
    "SupportsLateInteraction", "SupportsEagle3", "SupportsLoRA",
    "SupportsMultiModal", "SupportsPP", "SupportsQuant", "SupportsMambaPrefixCaching",
    "SupportsReplaySSM", "MambaStateShapes", "HasNoOps",
    "has_inner_state", "is_attention_free", "is_hybrid", "needs_state_slots",
    "is_mixture_of_experts", "is_pooling_model", "is_text_generation_model", "is_vllm_model",
    "supports_eagle", "supports_eagle3", "supports_lora", "supports_multimodal", "supports_pp",
    "supports_quant",
]


@runtime_checkable
class SupportsPP(Protocol):
    """The model runs split into pipeline stages (placeholders + IntermediateTensors)."""

    supports_pp: ClassVar[Literal[True]] = True

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype,
                                        device: torch.device) -> IntermediateTensors:
        ...

    def forward(self, *, intermediate_tensors: IntermediateTensors | None) -> Any:
        ...


@runtime_checkable
class SupportsLoRA(Protocol):
    supports_lora: ClassVar[Literal[True]] = True
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    embedding_modules: ClassVar[dict[str, str]] = {}
    is_3d_moe_weight: ClassVar[bool] = False
    is_non_gated_moe: ClassVar[bool] = False
    lora_skip_prefixes: ClassVar[list[str]] = []


@runtime_checkable
class IsHybrid(Protocol):
    """Some layers keep a per-sequence recurrent state (a short convolution's last inputs, a
    Mamba state) instead of, or beside, a KV cache: the engine gives each running sequence a
    state slot and turns prefix caching off (a cached prefix would skip building the state)."""

    is_hybrid: ClassVar[Literal[True]] = True


@runtime_checkable
class HasInnerState(Protocol):
    """The model keeps per-sequence state between steps (Mamba, short convolutions): the
    engine gives each running sequence a state slot, as for `IsHybrid`."""

    has_inner_state: ClassVar[Literal[True]] = True


@runtime_checkable
class IsAttentionFree(Protocol):
    """No attention layer at all (Mamba, Mamba-2): the model needs no KV cache."""

    is_attention_free: ClassVar[Literal[True]] = True


@runtime_checkable
class SupportsMambaPrefixCaching(Protocol):
    """vLLM caches such a model's states at block boundaries ("align" mode). minivllm does
    not: prefix caching stays off for every model with inner state (`engine/model_defaults.prefix_caching`)."""

    supports_mamba_prefix_caching: ClassVar[Literal[True]] = True


# What a hybrid file's `get_mamba_state_shape_from_config` returns: one shape per state tensor
# (conv, then SSM, ...), each without the sequence-slot dimension. minivllm's state layers size
# their buffers themselves (`mamba_utils.register_state_buffers`); the alias is for signatures.
MambaStateShapes = tuple[tuple[int, ...], ...]


@runtime_checkable
class HasNoOps(Protocol):
    """Some layers skip attention or the MLP (Nemotron-NAS's `no_op` blocks). minivllm needs
    nothing more: caches are sized from the attention layers that exist."""

    has_noops: ClassVar[Literal[True]] = True


@runtime_checkable
class SupportsReplaySSM(Protocol):
    """vLLM's experimental ReplaySSM decode (a ring of recent inputs replayed into the state).
    minivllm has no such cache mode: a model declaring it runs the plain recurrent decode."""

    supports_replayssm: ClassVar[Literal[True]] = True


@runtime_checkable
class SupportsEagle(Protocol):
    supports_eagle: ClassVar[Literal[True]] = True
    has_own_lm_head: ClassVar[bool] = False
    has_own_embed_tokens: ClassVar[bool] = False


@runtime_checkable
class SupportsEagle3(Protocol):
    """EAGLE-3 drafters read hidden states of chosen layers; these two bodies are inherited."""

    supports_eagle3: ClassVar[Literal[True]] = True
    has_own_lm_head: ClassVar[bool] = False
    has_own_embed_tokens: ClassVar[bool] = False

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        holder = _aux_holder(self)
        assert isinstance(holder, EagleModelMixin), (
            "Model instance must inherit from EagleModelMixin to set auxiliary layers")
        holder._set_aux_hidden_state_layers(layers)

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        holder = _aux_holder(self)
        assert hasattr(holder, "layers"), "Model instance must have 'layers' to pick default aux layers"
        num_layers = len(holder.layers)
        return (2, num_layers // 2, num_layers - 3)


@runtime_checkable
class SupportsMultiModal(Protocol):
    supports_multimodal: ClassVar[Literal[True]] = True


@runtime_checkable
class SupportsCrossEncoding(Protocol):
    supports_cross_encoding: ClassVar[Literal[True]] = True


@runtime_checkable
class SupportsLateInteraction(Protocol):
    """Per-token embeddings scored by MaxSim (ColBERT); minivllm serves them as token_embed."""

    score_type: ClassVar[str] = "late-interaction"


@runtime_checkable
class MixtureOfExperts(Protocol):
    """A MoE model's expert counts and its MoE layers (vLLM 0.33's interface, which its MoE files
    inherit). minivllm places experts once at load time: there is no load balancer (EPLB), so
    physical experts equal logical ones and `set_eplb_state` refuses."""

    expert_weights: list
    num_moe_layers: int
    num_expert_groups: int
    num_logical_experts: int
    num_physical_experts: int
    num_local_physical_experts: int
    num_routed_experts: int
    num_shared_experts: int
    num_redundant_experts: int
    moe_layers: list

    def set_eplb_state(self, expert_load_view: torch.Tensor,
                       logical_to_physical_map: torch.Tensor,
                       logical_replica_count: torch.Tensor) -> None:
        raise NotImplementedError("expert load balancing (EPLB) is not supported")

    def update_physical_experts_metadata(self, num_physical_experts: int,
                                         num_local_physical_experts: int) -> None:
        ...


def is_mixture_of_experts(model: object) -> bool:
    return isinstance(model, MixtureOfExperts) and getattr(model, "num_moe_layers", 0) > 0


class EagleModelMixin:
    """Collects the hidden states of selected layers (global indices) for EAGLE-3 drafters.

    Aux index k is the input of layer k (index 0 = the embeddings).
    """

    aux_hidden_state_layers: tuple[int, ...] = ()
    supports_aux_hidden_states_over_pp: bool = False
    AUX_HIDDEN_STATE_KEY = "aux_hidden_states_"
    # PP layout: number of selected indices captured by earlier stages, and whether we are last.
    _aux_remote_count: int = 0
    _aux_is_last_rank: bool = True

    def _set_aux_hidden_state_layers(self, layers: Iterable[int]) -> None:
        self.aux_hidden_state_layers = tuple(sorted(set(layers)))
        self._aux_remote_count, self._aux_is_last_rank = 0, True
        if not model_parallel_is_initialized() or get_pp_group().world_size < 2:
            return
        pp = get_pp_group()
        if not self.supports_aux_hidden_states_over_pp:
            raise NotImplementedError(f"{type(self).__name__} cannot collect EAGLE-3 aux hidden "
                                      "states over pipeline parallelism")
        start = getattr(self, "start_layer", 0)
        if not pp.is_first_rank:
            self._aux_remote_count = sum(1 for i in self.aux_hidden_state_layers if i <= start)
        self._aux_is_last_rank = pp.is_last_rank

    def _maybe_add_hidden_state(self, aux_hidden_states: list[torch.Tensor], layer_idx: int,
                                hidden_states: torch.Tensor, residual: torch.Tensor | None
                                ) -> list[torch.Tensor]:
        """Appends layer `layer_idx`'s input when it is an aux layer; returns the list (vLLM
        0.33's files start it as `aux = self._maybe_add_hidden_state([], ...)`)."""
        if layer_idx in self.aux_hidden_state_layers:
            aux_hidden_states.append(hidden_states if residual is None else hidden_states + residual)
        return aux_hidden_states

    def pack_local_aux_hidden_states(self, aux_hidden_states: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        base = self._aux_remote_count
        return {f"{self.AUX_HIDDEN_STATE_KEY}{base + i}": t for i, t in enumerate(aux_hidden_states)}

    def collect_remote_aux_hidden_states(
            self, intermediate_tensors: IntermediateTensors | None) -> list[torch.Tensor]:
        if not self._aux_is_last_rank or self._aux_remote_count == 0 or intermediate_tensors is None:
            return []
        keys = [f"{self.AUX_HIDDEN_STATE_KEY}{i}" for i in range(self._aux_remote_count)]
        missing = [k for k in keys if k not in intermediate_tensors.tensors]
        if missing:
            raise RuntimeError(f"Missing aux_hidden_states_i from PP intermediate tensors: {missing}")
        return [intermediate_tensors.tensors[k] for k in keys]


class LocalArgmaxMixin:
    """Greedy token ids without gathering the full vocab (spec-decode proposers)."""

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        top = self.logits_processor.get_top_tokens(self.lm_head, hidden_states)
        draft_to_target = getattr(self, "draft_id_to_target_id", None)
        if draft_to_target is not None:
            # Drafter vocab index k maps to target id k + d2t[k].
            top = top + draft_to_target[top]
        return top


class SupportsQuant:
    """Wires the quant config before `__init__`, so layers see the model's name mappings."""

    hf_to_vllm_mapper: ClassVar[Any] = None
    packed_modules_mapping: ClassVar[dict[str, list[str]]]
    quant_config: Any = None

    def __new__(cls, *args: Any, **kwargs: Any):
        instance = super().__new__(cls)
        quant_config = cls._find_quant_config(*args, **kwargs)
        instance.quant_config = quant_config
        if quant_config is not None:
            if cls.hf_to_vllm_mapper is not None and hasattr(quant_config, "apply_vllm_mapper"):
                quant_config.apply_vllm_mapper(cls.hf_to_vllm_mapper.get_rename_mapper())
            packed = getattr(cls, "packed_modules_mapping", None)
            if packed is not None:
                quant_config.packed_modules_mapping.update(packed)
        return instance

    @staticmethod
    def _find_quant_config(*args: Any, **kwargs: Any) -> Any:
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, VllmConfig):
                return arg.quant_config
            if isinstance(arg, QuantizationConfig):
                return arg
        return None


def supports_pp(model: type | object) -> bool:
    cls = model if isinstance(model, type) else type(model)
    has_attributes = SupportsPP in cls.__mro__ or (
        bool(getattr(model, "supports_pp", False))
        and all(hasattr(model, a) for a in ("make_empty_intermediate_tensors", "forward")))
    has_kw = supports_kw(getattr(model, "forward", None), "intermediate_tensors")
    if has_attributes and not has_kw:
        logger.warning("%s declares SupportsPP but forward() takes no `intermediate_tensors`.",
                       cls.__name__)
    elif has_kw and not has_attributes:
        logger.warning("%s.forward takes `intermediate_tensors` but the class does not implement "
                       "SupportsPP.", cls.__name__)
    return has_attributes and has_kw


def supports_lora(model: type | object) -> bool:
    return bool(getattr(model, "supports_lora", False)) and all(
        hasattr(model, a) for a in ("packed_modules_mapping", "embedding_modules"))


def supports_eagle(model: type | object) -> bool:
    return _matches(model, SupportsEagle, ("supports_eagle", "has_own_lm_head", "has_own_embed_tokens"))


def supports_eagle3(model: type | object) -> bool:
    return _matches(model, SupportsEagle3, ("supports_eagle3", "set_aux_hidden_state_layers",
                                            "get_eagle3_default_aux_hidden_state_layers"))


def supports_multimodal(model: type | object) -> bool:
    return bool(getattr(model, "supports_multimodal", False))


def supports_quant(model: type | object) -> bool:
    cls = model if isinstance(model, type) else type(model)
    return issubclass(cls, SupportsQuant)


def is_text_generation_model(model: type | object) -> bool:
    return is_vllm_model(model) and callable(getattr(model, "compute_logits", None))


def _matches(model: type | object, protocol: type, members: tuple[str, ...]) -> bool:
    # Instances use the runtime-checkable Protocol; classes (where issubclass would reject a
    # Protocol with data members) check the same members by hand.
    if not isinstance(model, type):
        return isinstance(model, protocol) and bool(getattr(model, members[0], False))
    return all(hasattr(model, m) for m in members) and bool(getattr(model, members[0], False))


def _aux_holder(model: Any) -> Any:
    if callable(getattr(model, "get_language_model", None)):
        model = model.get_language_model()
    elif hasattr(model, "language_model"):
        model = model.language_model
    return model.model if hasattr(model, "model") else model


def is_hybrid(model: Any) -> bool:
    return getattr(model, "is_hybrid", False) is True


def has_inner_state(model: Any) -> bool:
    return getattr(model, "has_inner_state", False) is True


def is_attention_free(model: Any) -> bool:
    return getattr(model, "is_attention_free", False) is True


def needs_state_slots(model: Any) -> bool:
    """Whether the runner must give each running sequence a recurrent-state slot."""
    return is_hybrid(model) or has_inner_state(model)

