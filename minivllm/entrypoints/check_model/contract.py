"""The contract and prefixes sections: constructor, capability protocols, packed modules, names."""

import inspect

import torch.nn as nn

from minivllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from minivllm.model_executor.models import interfaces as itf
from minivllm.model_executor.models.prefix_check import check_prefixes
from minivllm.model_executor.models.utils import extract_layer_index

from .report import Section

_PROTOCOLS = {"SupportsPP": itf.supports_pp, "SupportsLoRA": itf.supports_lora,
              "SupportsQuant": itf.supports_quant, "SupportsEagle": itf.supports_eagle,
              "SupportsEagle3": itf.supports_eagle3}


def check_constructor(section: Section, model_class: type[nn.Module]) -> bool:
    """`__init__` must take `vllm_config` and `prefix` by keyword (contract §6.3)."""
    params = inspect.signature(model_class.__init__).parameters
    bad = [name for name in ("vllm_config", "prefix")
           if name not in params or params[name].kind is inspect.Parameter.POSITIONAL_ONLY]
    if bad:
        section.error("constructor", f"{model_class.__name__}.__init__ does not take "
                      f"{' and '.join(bad)} by keyword; vLLM builds every model as "
                      "cls(vllm_config=..., prefix=...)",
                      fix="def __init__(self, *, vllm_config: VllmConfig, prefix: str = '')")
        return False
    return True


def contract_section(section: Section, model_class: type[nn.Module], model: nn.Module) -> None:
    """Protocols the class declares, and what each of them needs from the built model."""
    protocols = {name: bool(check(model_class)) for name, check in _PROTOCOLS.items()}
    section.data["protocols"] = protocols
    forward = getattr(model_class, "forward", None)
    for kw in ("input_ids", "positions"):
        if not itf.supports_kw(forward, kw):
            section.error("forward_signature", f"forward() takes no `{kw}` keyword")
    if not callable(getattr(model_class, "embed_input_ids", None)):
        section.warning("embed_input_ids", "no embed_input_ids(): the runner cannot embed "
                        "prompts itself (inputs_embeds, speculative decoding)")
    if not callable(getattr(model_class, "compute_logits", None)) and \
            not getattr(model_class, "is_pooling_model", False):
        section.error("compute_logits", "neither compute_logits() nor is_pooling_model: the "
                      "class is neither a text generation nor a pooling model")
    if itf.SupportsPP in model_class.__mro__:
        _check_pp(section, model_class, model)
    if itf.SupportsEagle3 in model_class.__mro__:
        _check_eagle3(section, model)
    _check_packed_modules(section, model_class, model, protocols)
    declared = [n for n, ok in protocols.items() if ok]
    section.summary = "protocols: " + (", ".join(declared) or "none")


def prefixes_section(section: Section, model: nn.Module, duplicates: list[str]) -> None:
    """Recorded prefix == attribute path; attention names unique, one layer index each."""
    for m in check_prefixes(model):
        section.error("prefix_mismatch", f"{m.module_type} was built with prefix {m.prefix!r}, "
                      f"but it sits at {m.path!r}: quantization, LoRA and the loader match the "
                      "prefix, so this layer gets another layer's treatment", layer=m.path,
                      fix=f"pass prefix=f\"{{prefix}}.{m.path.rsplit('.', 1)[-1]}\" where "
                      f"{m.path.rsplit('.', 1)[0] or 'the model'} builds it")
    attention = {path: module.layer_name for path, module in model.named_modules()
                 if isinstance(getattr(module, "layer_name", None), str)}
    holders: dict[str, list[str]] = {}
    for path, name in attention.items():
        holders.setdefault(name, []).append(path)
    for name in sorted(set(duplicates) | {n for n, paths in holders.items() if len(paths) > 1}):
        paths = holders.get(name, [])
        culprits = [p for p in paths if p != name] or paths
        section.error("duplicate_attention_name",
                      f"attention layer name {name!r} is registered by {len(paths) or 2} layers "
                      f"({', '.join(paths)}): the forward context and the KV cache key on it",
                      layer=culprits[0] if culprits else name)
    for path, name in attention.items():
        try:
            extract_layer_index(name)
        except AssertionError:
            section.error("layer_index", f"attention name {name!r} must hold exactly one layer "
                          "index (extract_layer_index): KV caches are bound per layer index",
                          layer=path)
    section.data["attention_layers"] = attention
    section.summary = f"{sum(1 for _ in model.named_modules())} modules, " \
                      f"{len(attention)} attention layers"


def _check_pp(section: Section, model_class: type[nn.Module], model: nn.Module) -> None:
    if not itf.supports_kw(getattr(model_class, "forward", None), "intermediate_tensors"):
        section.error("pp_forward", "SupportsPP is declared but forward() takes no "
                      "`intermediate_tensors`: later pipeline stages cannot get their inputs")
    own = "make_empty_intermediate_tensors" in vars(model)
    inherited = getattr(type(model), "make_empty_intermediate_tensors", None)
    if not own and (inherited is None or inherited is itf.SupportsPP.make_empty_intermediate_tensors):
        section.error("pp_intermediate", "SupportsPP is declared but the model keeps the "
                      "protocol's empty make_empty_intermediate_tensors: set it from "
                      "make_empty_intermediate_tensors_factory(...)")


def _check_eagle3(section: Section, model: nn.Module) -> None:
    # Each inherited protocol body needs its own thing of the inner model: storing the layers an
    # EagleModelMixin, the default choice `layers` (vLLM's DeepSeek file overrides the first).
    cls, holder = type(model), itf._aux_holder(model)
    inherits = {m: getattr(cls, m) is getattr(itf.SupportsEagle3, m)
                for m in ("set_aux_hidden_state_layers",
                          "get_eagle3_default_aux_hidden_state_layers")}
    if inherits["set_aux_hidden_state_layers"] and not isinstance(holder, itf.EagleModelMixin):
        section.error("eagle3", f"SupportsEagle3 is declared but {type(holder).__name__} (the "
                      "inner model) is not an EagleModelMixin and set_aux_hidden_state_layers "
                      "is the protocol's: EAGLE-3 cannot read its auxiliary hidden states")
    if inherits["get_eagle3_default_aux_hidden_state_layers"] and not hasattr(holder, "layers"):
        section.error("eagle3", f"SupportsEagle3 is declared but {type(holder).__name__} (the "
                      "inner model) has no `layers` to choose the default auxiliary layers from")


def _check_packed_modules(section: Section, model_class: type[nn.Module], model: nn.Module,
                          protocols: dict[str, bool]) -> None:
    """Every fused layer is in `packed_modules_mapping`, with as many names as it has shards
    (or only its own name, when the checkpoint holds it fused already)."""
    mapping = getattr(model_class, "packed_modules_mapping", None) or {}
    needed = protocols["SupportsLoRA"] or protocols["SupportsQuant"] or bool(mapping)
    seen: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, (MergedColumnParallelLinear, QKVParallelLinear)):
            continue
        name = path.rsplit(".", 1)[-1]
        shards = len(module.output_sizes)
        seen.add(name)
        if name not in mapping:
            if needed:
                section.error("packed_missing", f"fused layer {name!r} ({shards} shards) is not "
                              "in packed_modules_mapping: quantization ignore lists and LoRA "
                              "target the checkpoint's shard names", layer=path)
            continue
        # [its own name]: the checkpoint stores the layer fused (LFM2's in_proj), one name.
        if len(mapping[name]) != shards and mapping[name] != [name]:
            section.error("packed_shard_count", f"packed_modules_mapping[{name!r}] lists "
                          f"{len(mapping[name])} names {mapping[name]}, but "
                          f"{type(module).__name__} {path} has {shards} shards", layer=path)
    for name in sorted(set(mapping) - seen):
        section.warning("packed_unused", f"packed_modules_mapping[{name!r}] names no fused "
                        "layer in the model")
