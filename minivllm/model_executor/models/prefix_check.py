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
    """Every module that recorded a prefix must have recorded its own attribute path."""
    mismatches = []
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = recorded_prefix(module)
        if prefix is None or module is model:
            continue
        expected = f"{root_prefix}.{path}" if root_prefix and path else (path or root_prefix)
        if prefix != expected:
            mismatches.append(PrefixMismatch(expected, prefix, type(module).__name__))
    return mismatches
