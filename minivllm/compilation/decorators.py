"""`@support_torch_compile`: compile a model's `forward` once, with dynamic token dims (contract §8).

Eager by default. With `compilation_config.mode` DYNAMO_TRACE_ONCE or VLLM_COMPILE the first call
marks the dynamic dims and builds one `torch.compile` of `forward`; later calls reuse it.
"""

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn as nn

from minivllm.config import CompilationMode, get_current_vllm_config
from minivllm.forward_context import get_forward_context, is_forward_context_available
from minivllm.sequence import IntermediateTensors

_T = TypeVar("_T", bound=type[nn.Module])
DimSpec = int | list[int] | dict[int, str]

IGNORE_COMPILE_KEY = "_ignore_compile_minivllm"
_DECORATED_KEY = "_support_torch_compile_minivllm"
# Annotations that mark an argument as dynamic on dim 0 when `dynamic_arg_dims` is omitted.
_TENSOR_TYPES = (torch.Tensor, torch.FloatTensor, IntermediateTensors)
_DYNAMIC_ANNOTATIONS = [*_TENSOR_TYPES, *(t | None for t in _TENSOR_TYPES)]


def ignore_torch_compile(cls: _T) -> _T:
    """Keep `cls` eager even when a base class is decorated with `support_torch_compile`."""
    setattr(cls, IGNORE_COMPILE_KEY, True)
    return cls


def support_torch_compile(cls: _T | None = None, *, dynamic_arg_dims: dict[str, DimSpec] | None = None,
                          mark_unbacked_dims: dict[str, DimSpec] | None = None,
                          enable_if: Callable[[Any], bool] | None = None, is_encoder: bool = False,
                          use_aot_compile: bool = True) -> Any:
    """Bare (`@support_torch_compile`) or with keywords; returns the decorated class."""

    def decorate(model_cls: _T) -> _T:
        if not hasattr(model_cls, "forward"):
            raise TypeError(f"decorated class {model_cls.__name__} should have a forward method.")
        dims = _dynamic_dims(model_cls, dynamic_arg_dims)
        return _decorate_class(model_cls, dims, mark_unbacked_dims or {}, enable_if)

    if cls is not None:
        assert isinstance(cls, type), "support_torch_compile decorates classes only"
        return decorate(cls)
    return decorate


def _dynamic_dims(cls: type, given: dict[str, DimSpec] | None) -> dict[str, DimSpec]:
    params = inspect.signature(cls.forward).parameters
    if given is None:
        # String annotations (postponed evaluation) do not match, as in vLLM.
        given = {name: 0 for name, p in params.items() if p.annotation in _DYNAMIC_ANNOTATIONS}
        if not given:
            raise ValueError(f"No dynamic dimensions found in the forward method of {cls}. "
                             "Please provide dynamic_arg_dims explicitly.")
    for name in given:
        if name not in params:
            raise ValueError(f"Argument {name} not found in the forward method of {cls}; "
                             f"its arguments are {list(params)}")
    return given


def _decorate_class(cls: _T, dims: dict[str, DimSpec], unbacked: dict[str, DimSpec],
                    enable_if: Callable[[Any], bool] | None) -> _T:
    if cls.__dict__.get(_DECORATED_KEY):
        return cls   # this very class was decorated already
    setattr(cls, _DECORATED_KEY, True)
    setattr(cls, IGNORE_COMPILE_KEY, False)
    old_init = cls.__init__
    old_params = inspect.signature(old_init).parameters

    def __init__(self, *args: Any, vllm_config: Any = None, prefix: str = "", **kwargs: Any) -> None:

        if vllm_config is None:
            vllm_config = get_current_vllm_config()
        _check_positional(cls, old_init, args)
        if "vllm_config" in old_params:
            kwargs["vllm_config"] = vllm_config
        if "prefix" in old_params:
            kwargs["prefix"] = prefix
        old_init(self, *args, **kwargs)
        self.vllm_config = vllm_config
        self.compilation_config = vllm_config.compilation_config
        self._allow_aot_compile = False   # no AOT artefacts on disk in minivllm
        mode = self.compilation_config.mode
        self.do_not_compile = (mode in (CompilationMode.NONE, CompilationMode.STOCK_TORCH_COMPILE)
                               or getattr(type(self), IGNORE_COMPILE_KEY, False)
                               or (enable_if is not None and not enable_if(vllm_config)))
        self._compiled_forward = None
        self._forward_signature = inspect.signature(self.forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.do_not_compile or torch.compiler.is_compiling() or _skip_compiled():
            return self.forward(*args, **kwargs)
        bound = self._forward_signature.bind(*args, **kwargs).arguments
        if _num_tokens(bound, dims) <= self.compilation_config.eager_max_tokens:
            return self.forward(*args, **kwargs)
        _mark_dims(bound, dims, torch._dynamo.maybe_mark_dynamic)
        _mark_dims(bound, unbacked, torch._dynamo.decorators.mark_unbacked)
        if self._compiled_forward is None:
            # One torch.compile for the module's lifetime; dynamo re-traces only for dims that
            # could not stay dynamic (size 0/1, or tied to an unmarked argument).
            # Round fused intermediates to their dtype as eager does (bf16 sums, norms): compiled
            # and eager runs then pick the same tokens where bf16 leaves near-ties.
            import torch._inductor.config as inductor_config

            # Here, not at the top: the pass imports inductor (~0.3 s), which eager runs skip.
            from minivllm.compilation.fusion import LinearSiluMulFusionPass

            inductor_config.emulate_precision_casts = True
            options: dict[str, Any] = {"guard_filter_fn": _input_guards_only}
            if self.compilation_config.backend == "inductor":
                options["post_grad_custom_post_pass"] = LinearSiluMulFusionPass()
            self._compiled_forward = torch.compile(
                self.forward, dynamic=False, fullgraph=False,
                backend=self.compilation_config.backend, options=options)
        return self._compiled_forward(*args, **kwargs)

    cls.__init__ = __init__
    cls.__call__ = __call__
    return cls


def _input_guards_only(guards: list[Any]) -> list[bool]:
    """Keep dynamo's guards on the forward's arguments, on global state and on module buffers;
    drop those on the rest of the module tree and module globals (hooks dicts, attribute
    presence, types, constants, parameters: ~5,900 for a 30-layer Llama, ~0.8 ms per step to
    check). As in vLLM, weights must then change in place, never by rebinding a parameter;
    buffers keep their guards because one is rebound on purpose (the rotary cache, converted to
    the activations' dtype by an eager step)."""
    fixed = ("self", "dict(type(self", "G[", "dict(type(G[")
    return [not guard.name.startswith(fixed) or "._buffers[" in guard.name for guard in guards]


def _num_tokens(bound: dict[str, Any], spec: dict[str, DimSpec]) -> int:
    """The size of the first dynamic dim among the arguments given (the step's token count)."""
    for name, dim_spec in spec.items():
        value = bound.get(name)
        if isinstance(value, IntermediateTensors):
            value = next(iter(value.tensors.values()), None)
        if isinstance(value, torch.Tensor):
            dims = list(dim_spec) if isinstance(dim_spec, (list, dict)) else [dim_spec]
            return value.shape[dims[0] % value.ndim]
    return 1 << 62


def _mark_dims(bound: dict[str, Any], spec: dict[str, DimSpec], mark: Callable[..., None]) -> None:
    for name, dim_spec in spec.items():
        value = bound.get(name)
        tensors = (list(value.tensors.values()) if isinstance(value, IntermediateTensors)
                   else [value] if isinstance(value, torch.Tensor) else [])
        dims = list(dim_spec) if isinstance(dim_spec, (list, dict)) else [dim_spec]
        for tensor in tensors:
            for dim in dims:
                dim = dim % tensor.ndim
                # Dynamo always specialises sizes 0 and 1; `maybe_` tolerates dims the code specialises.
                if tensor.shape[dim] > 1:
                    mark(tensor, dim)


def _skip_compiled() -> bool:
    return is_forward_context_available() and get_forward_context().skip_compiled


def _check_positional(cls: type, old_init: Callable[..., None], args: tuple) -> None:
    """Positional constructor arguments must match the original annotations."""
    if not args:
        return
    params = [p for p in inspect.signature(old_init).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]   # drop self
    for param, arg in zip(params, args):
        expected = param.annotation
        if expected in (inspect.Parameter.empty, Any):
            continue
        if isinstance(expected, type) and not isinstance(arg, expected):
            raise TypeError(f"{cls.__name__}.__init__ received a positional argument of type "
                            f"{type(arg).__name__} for {param.name!r}, annotated {expected.__name__}")
        if typing.get_origin(expected) not in (typing.Union, types.UnionType):
            continue
        options = typing.get_args(expected)
        if all(isinstance(a, type) for a in options) and not isinstance(arg, options):
            raise TypeError(f"{cls.__name__}.__init__ received a positional argument of type "
                            f"{type(arg).__name__} for {param.name!r}, annotated {expected}")

