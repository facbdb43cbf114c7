"""CustomOp (forward implementation chosen per platform at construction) and PluggableLayer.

A `CustomOp` subclass provides `forward_native` (plain PyTorch, the numerics reference) and may
override `forward_cuda` / `forward_cpu` / ... with faster paths. Which one runs is decided once, in
`__init__`, from the current `CompilationConfig.custom_ops` list ("all"/"none" plus "+name"/"-name").
A `PluggableLayer` has no per-platform dispatch; like CustomOp it can be replaced out of tree.
"""

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from minivllm.config import get_cached_compilation_config, get_current_vllm_config
from minivllm.config.compilation import CompilationMode

# name -> class, for in-tree ops (CustomOp and PluggableLayer share the name space, as in vLLM)
op_registry: dict[str, type[nn.Module]] = {}
# in-tree class name -> out-of-tree replacement class
op_registry_oot: dict[str, type[nn.Module]] = {}


def current_platform() -> str:
    """Return "cuda" when the current config asks for CUDA and a GPU exists, else "cpu"."""
    device = get_current_vllm_config().device_config.device
    return "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"


def maybe_get_oot_by_class(cls: type) -> type:
    """The out-of-tree class registered under `cls.__name__`, else `cls` itself."""
    return op_registry_oot.get(cls.__name__, cls)


def _register(name: str) -> Callable[[type], type]:
    def decorator(op_cls: type) -> type:
        assert name not in op_registry, f"Duplicate op name: {name}"
        op_cls.name = name
        op_registry[name] = op_cls
        return op_cls
    return decorator


def _register_oot(base: type, decorated: type | None, name: str | None) -> Any:
    def decorator(op_cls: type) -> type:
        reg_name = name if name is not None else base.__name__
        assert reg_name not in op_registry_oot, f"Duplicate out-of-tree op name: {reg_name}"
        op_cls.name = reg_name
        op_registry_oot[reg_name] = op_cls
        return op_cls
    return decorator if decorated is None else decorator(decorated)


class PluggableLayer(nn.Module):
    """A layer with a single `forward` that an out-of-tree plugin may substitute by class name."""

    name: str = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> "PluggableLayer":
        return super().__new__(maybe_get_oot_by_class(cls))

    @classmethod
    def register(cls, name: str) -> Callable[[type], type]:
        return _register(name)

    @classmethod
    def register_oot(cls, _decorated_op_cls: type | None = None, name: str | None = None) -> Any:
        """`@RMSNorm.register_oot` or `@CustomOp.register_oot(name="RMSNorm")`."""
        return _register_oot(cls, _decorated_op_cls, name)


class CustomOp(nn.Module):
    """Base of ops with per-platform forwards; `forward` calls the one bound at construction."""

    name: str = ""
    _dynamic_arg_dims: dict[str, int | list[int]] | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "CustomOp":
        return super().__new__(maybe_get_oot_by_class(cls))

    def __init__(self, *, enforce_enable: bool = False, compile_native: bool = False) -> None:
        super().__init__()
        self._enforce_enable = enforce_enable
        self._forward_method = self.dispatch_forward(compile_native)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        """Plain PyTorch implementation; every other path must match its numerics."""
        raise NotImplementedError

    # NOTE: each platform path defaults to the native one; a subclass overrides the one it has a
    # kernel for (SiluAndMul's `forward_cpu` calls the native kernel, see model_executor/kernels/).
    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_hip(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_cuda(*args, **kwargs)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_xpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_tpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def dispatch_forward(self, compile_native: bool = False) -> Callable[..., Any]:
        compilation_config = get_cached_compilation_config()
        enabled = self._enforce_enable or self.enabled()
        if enabled:
            compilation_config.enabled_custom_ops.add(self.__class__.name)
        else:
            compilation_config.disabled_custom_ops.add(self.__class__.name)
        if not enabled:
            return self._maybe_compile(self.forward_native, compile_native)
        return self.forward_cuda if current_platform() == "cuda" else self.forward_cpu

    @classmethod
    def enabled(cls) -> bool:
        """On by default under "all", off under "none"; "+name"/"-name" override the default."""
        custom_ops = get_cached_compilation_config().custom_ops
        plus, minus = f"+{cls.name}" in custom_ops, f"-{cls.name}" in custom_ops
        if plus and minus:
            raise ValueError(f"Cannot both enable and disable custom op {cls.name!r} "
                             f"(custom_ops={custom_ops})")
        return (CustomOp.default_on() or plus) and not minus

    @staticmethod
    def default_on() -> bool:
        custom_ops = get_cached_compilation_config().custom_ops
        count_all, count_none = custom_ops.count("all"), custom_ops.count("none")
        if count_all + count_none != 1:
            raise ValueError("custom_ops must contain exactly one of 'all' or 'none', "
                             f"got {custom_ops}")
        return count_all == 1

    @classmethod
    def register(cls, name: str,
                 dynamic_arg_dims: dict[str, int | list[int]] | None = None) -> Callable[[type], type]:
        register = _register(name)

        def decorator(op_cls: type) -> type:
            op_cls._dynamic_arg_dims = dynamic_arg_dims
            return register(op_cls)
        return decorator

    @classmethod
    def register_oot(cls, _decorated_op_cls: type | None = None, name: str | None = None) -> Any:
        return _register_oot(cls, _decorated_op_cls, name)

    def _maybe_compile(self, fn: Callable[..., Any], compile_native: bool) -> Callable[..., Any]:
        config = get_cached_compilation_config()
        if not compile_native or config.mode == CompilationMode.NONE or config.backend == "eager":
            return fn
        dims = self._dynamic_arg_dims
        if not dims:
            return torch.compile(fn, dynamic=True, backend=config.backend)
        compiled = torch.compile(fn, backend=config.backend)
        signature = inspect.signature(fn)

        def marked(*args: Any, **kwargs: Any) -> Any:
            # Mark the named tensor arguments' dims dynamic so one graph serves every token count.
            bound = signature.bind(*args, **kwargs)
            for arg_name, arg_dims in dims.items():
                value = bound.arguments.get(arg_name)
                if isinstance(value, torch.Tensor):
                    torch._dynamo.mark_dynamic(value, arg_dims)
            return compiled(*args, **kwargs)
        return marked
