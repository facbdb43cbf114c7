"""Torch helpers vLLM's files import from `vllm.utils.torch_utils`."""

import contextlib
from collections.abc import Callable, Iterator

import torch
from packaging.version import Version

from minivllm.platforms import current_platform

# The KV-cache / model dtype strings vLLM accepts.
STR_DTYPE_TO_TORCH_DTYPE: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "half": torch.float16,
    "float16": torch.float16, "bfloat16": torch.bfloat16, "fp8": torch.uint8,
    "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8, "int8": torch.int8, "uint8": torch.uint8,
}

# The type of a custom op's layer-name argument. vLLM wraps names in an opaque `LayerName` on
# torch >= 2.11 so compiled graphs do not bake them in; minivllm's ops take plain strings.
LayerNameType = str


def _encode_layer_name(layer_name: str) -> LayerNameType:
    """A layer's name as a custom op argument (the string itself here)."""
    return layer_name


def _resolve_layer_name(layer_name: LayerNameType) -> str:
    """The layer name a custom op received, as the forward context's key."""
    return layer_name


# Ops registered here live under `torch.ops.minivllm.<name>` (minivllm's own op namespace)
# and, as vLLM's `direct_register_custom_op` puts them, under `torch.ops.vllm.<name>`: a model
# file written for vLLM registers an op and then calls it by that name.
_LIB = torch.library.Library("minivllm", "FRAGMENT")
_VLLM_LIB = torch.library.Library("vllm", "FRAGMENT")


@contextlib.contextmanager
def set_default_torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside get `dtype`; the previous default comes back on exit."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old_dtype)


def get_dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return torch.tensor([], dtype=dtype).element_size()


def is_torch_equal_or_newer(target: str) -> bool:
    """Whether the installed torch is at least `target` ("2.6.0"); local suffixes ignored."""
    return Version(Version(torch.__version__).base_version) >= Version(target)


def is_torch_equal(target: str) -> bool:
    return Version(Version(torch.__version__).base_version) == Version(target)


def set_random_seed(seed: int | None) -> None:
    """Seed Python's, NumPy's and torch's generators (the platform's `seed_everything`)."""
    current_platform.seed_everything(seed)


def direct_register_custom_op(op_name: str, op_func: Callable,
                              mutates_args: list[str] | None = None,
                              fake_impl: Callable | None = None,
                              target_lib: torch.library.Library | None = None,
                              dispatch_key: str | None = None,
                              tags: tuple[torch.Tag, ...] = ()) -> None:
    """Register `op_func` as the op `torch.ops.<namespace>.<op_name>`, its schema inferred from
    its annotations; `fake_impl` gives shapes to compiled graphs. The kernel is registered for
    the current platform's dispatch key (CPU or CUDA) unless `dispatch_key` says otherwise."""
    schema = torch.library.infer_schema(op_func, mutates_args=mutates_args or [])
    for lib in ([target_lib] if target_lib is not None else [_LIB, _VLLM_LIB]):
        lib.define(op_name + schema, tags=tags)
        lib.impl(op_name, op_func, dispatch_key or current_platform.dispatch_key)
        if fake_impl is not None:
            torch.library.register_fake(f"{lib.ns}::{op_name}", lib=lib)(fake_impl)
