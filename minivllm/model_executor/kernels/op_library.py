"""`register_op`: defines minivllm's opaque ops (`torch.ops.minivllm.*`) that compiled graphs call.

NOTE: `torch.library.Library` + `register_fake` rather than `torch.library.custom_op`: the
latter's Python wrapper (autograd and aliasing checks) cost ~25 us per call against ~6 us here,
and a batched decode step calls these ops ~150 times (a linear or attention per call).
"""

from collections.abc import Callable

import torch

_LIB = torch.library.Library("minivllm", "FRAGMENT")


def register_op(schema: str, impl: Callable, fake: Callable) -> None:
    """Defines `minivllm::<name>` from `schema` ("name(Tensor x, ...) -> Tensor"), its
    implementation for every backend (inference only: no autograd formula) and its fake."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"minivllm::{name}", lib=_LIB)(fake)
