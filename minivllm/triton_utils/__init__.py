"""`triton` and `triton.language` for vLLM's model files (vLLM's `triton_utils`).

A file may define Triton kernels at import time (`@triton.jit`, `tl.constexpr` annotations)
and launch them only on CUDA / XPU. Where Triton is installed these are the real modules.
Elsewhere (every CPU install: torch's CPU wheel brings no Triton) they are stand-ins that let
such a file import: decorators hand back a kernel that raises a clear error if launched, the
host-side helpers (`cdiv`, `next_power_of_2`) compute, and `tl.<anything>` is an inert name.
"""

import importlib.util
import math
import types
from collections.abc import Callable
from typing import Any

HAS_TRITON = importlib.util.find_spec("triton") is not None
LOG2E = math.log2(math.e)


class _UnlaunchableKernel:
    """What `@triton.jit` gives back without Triton: `kernel[grid](...)` or `kernel(...)`
    raises, naming the kernel."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self.__call__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"Triton kernel {self.__name__!r} cannot run: Triton is not "
                           "installed (CPU builds take the model file's PyTorch path)")


def _kernel_decorator(*args: Any, **kwargs: Any) -> Any:
    """@jit, @jit(...), @autotune(...), @heuristics(...): all become an unlaunchable kernel."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        fn = args[0]
        return fn if isinstance(fn, _UnlaunchableKernel) else _UnlaunchableKernel(fn)
    return _kernel_decorator


class _InertName:
    """`tl.float32`, `tl.constexpr`, `tl.math.exp`, ...: usable as annotations and defaults,
    and as further attributes; calling one is a kernel body running, which cannot happen."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_InertName":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _InertName(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is Triton device code; Triton is not installed")

    def __repr__(self) -> str:
        return f"<Triton placeholder {self._name}>"


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _InertName(f"{self.__name__}.{attr}")


def _placeholders() -> tuple[types.ModuleType, types.ModuleType]:
    triton_mod = _PlaceholderModule("triton")
    triton_mod.jit = triton_mod.autotune = triton_mod.heuristics = _kernel_decorator
    triton_mod.cdiv = lambda a, b: -(-a // b)
    triton_mod.next_power_of_2 = lambda n: 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
    triton_mod.Config = lambda *args, **kwargs: (args, kwargs)
    language = _PlaceholderModule("triton.language")
    triton_mod.language = language
    return triton_mod, language


if HAS_TRITON:
    import triton
    import triton.language as tl
else:
    triton, tl = _placeholders()

__all__ = ["HAS_TRITON", "LOG2E", "tl", "triton"]
