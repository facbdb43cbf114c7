"""check_prefixes: find layers whose `prefix` differs from their attribute path in the module tree.

vLLM never checks this, but quantization, LoRA and the loader all match names, so a wrong prefix
silently gives a layer the wrong treatment (seed: "What can go wrong").
"""

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class PrefixMismatch:
    path: str          # where the module sits in the tree
    prefix: str        # what the module was told at construction
    module_type: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.module_type} was built with prefix {self.prefix!r}"


def recorded_prefix(module: nn.Module) -> str | None:
    """The name a layer registered under (`layer_name` for attention, else `prefix`), if any."""
    for attr in ("layer_name", "prefix"):
        value = getattr(module, attr, None)
        if isinstance(value, str):
            return value
    return None


def check_prefixes(model: nn.Module, root_prefix: str = "") -> list[PrefixMismatch]:
    """Every module that recorded a prefix must have recorded its own attribute path.

    A module held at two places (vLLM 0.33's MoE runner holds the gate the block built) is
    judged at its first. A parent may name children that carry its own prefix in
    `prefix_shared_children` (the runner's `routed_experts`: checkpoint names have no such part),
    or children built under another name in `prefix_renamed_children` (MLA's `mla_attn` is
    `<prefix>.attn`, as in vLLM); a module with `records_parent_prefix` carries its parent's
    (vLLM's MLA wrapper, built with the attention block's prefix).
    """
    mismatches = []
    expected_of: dict[str, str] = {"": root_prefix}
    seen: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        if path:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            parent_expected = expected_of.get(parent_path, root_prefix)
            shared = (name in getattr(parent, "prefix_shared_children", ())
                      or getattr(module, "records_parent_prefix", False))
            name = getattr(parent, "prefix_renamed_children", {}).get(name, name)
            expected_of[path] = (parent_expected if shared else
                                 f"{parent_expected}.{name}" if parent_expected else name)
        if id(module) in seen:
            continue
        seen.add(id(module))
        prefix = recorded_prefix(module)
        if prefix is None or module is model:
            continue
        if prefix != expected_of[path]:
            mismatches.append(PrefixMismatch(expected_of[path], prefix, type(module).__name__))
    return mismatches
