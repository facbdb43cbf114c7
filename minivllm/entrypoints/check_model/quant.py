"""The quantization section: the method every layer got, and ignore entries that reach no layer.

Quant configs match their ignore lists against the `prefix` a layer was built with, never its
place in the tree; an entry that matches no prefix leaves its layer quantized without a word
(the seed's "FP8 on an ignored layer").
"""

import re
from collections import Counter

import torch.nn as nn

from minivllm.model_executor.models.prefix_check import recorded_prefix

from .report import Section
from .weights import nearest

# Config attribute -> how its entries match a layer prefix (as each method's get_quant_method).
_IGNORE_LISTS = {"ignored_layers": "exact",            # fp8, int8, int4
                 "modules_to_not_convert": "substring",  # AWQ
                 "ignore": "exact_or_regex"}           # compressed-tensors ("re:" entries)


def quantization_section(section: Section, model: nn.Module, quant_config: object) -> None:
    layers = _quantized_layers(model)
    methods = {path: type(m.quant_method).__name__ for path, m in layers.items()}
    section.data["methods"] = methods
    counts = Counter(methods.values())
    name = quant_config.get_name() if quant_config is not None else "none"
    section.summary = f"{name}: " + ", ".join(f"{n} x {m}" for m, n in sorted(counts.items()))
    section.data["quantization"] = name
    if quant_config is None:
        return
    prefixes = _layer_names(model, layers)
    for attr, mode in _IGNORE_LISTS.items():
        for entry in getattr(quant_config, attr, None) or []:
            if any(_matches(entry, p, mode) for p in prefixes):
                continue
            _report_unmatched(section, attr, entry, layers, prefixes, methods)
    # The text report lists the exceptions (the JSON has every layer).
    common = counts.most_common(1)[0][0] if counts else None
    section.text_rows.extend(f"{path:48} {method}" for path, method in methods.items()
                             if method != common)


def _report_unmatched(section: Section, attr: str, entry: str, layers: dict[str, nn.Module],
                      prefixes: dict[str, str], methods: dict[str, str]) -> None:
    """An entry that reaches no layer; the layer it was most likely meant for, and why."""
    target = entry.removeprefix("re:")
    if target in layers:      # the tree has it: the layer was built with another prefix
        got = recorded_prefix(layers[target])
        section.error("ignored_unmatched", f"{attr} entry {entry!r} matches no layer: the "
                      f"layer at {target!r} was built with prefix {got!r}, so it was not "
                      f"skipped and got {methods[target]}", layer=target,
                      fix="build the layer with prefix equal to its attribute path")
        return
    best, _ = nearest(target, list(prefixes))
    owner = prefixes.get(best) if best else None
    section.error("ignored_unmatched", f"{attr} entry {entry!r} matches no layer of the "
                  f"model" + (f"; nearest layer: {best!r}" if best else ""), layer=owner,
                  fix="name the layer as the model's tree does (a checkpoint name that the "
                  "model renames needs the rename in hf_to_vllm_mapper)")


def _quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {path: m for path, m in model.named_modules()
            if getattr(m, "quant_method", None) is not None and path}


def _layer_names(model: nn.Module, layers: dict[str, nn.Module]) -> dict[str, str]:
    """Each name a config can match (a layer's prefix, and each shard's for a fused layer)
    -> the layer's path in the tree."""
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    names: dict[str, str] = {}
    for path, module in layers.items():
        prefix = recorded_prefix(module) or path
        names[prefix] = path
        head, _, last = prefix.rpartition(".")
        for shard in mapping.get(last, []):
            names[f"{head}.{shard}" if head else shard] = path
    return names


def _matches(entry: str, prefix: str, mode: str) -> bool:
    if mode == "substring":
        return entry in prefix
    if mode == "exact_or_regex" and entry.startswith("re:"):
        return re.match(entry[3:], prefix) is not None
    return entry == prefix
