"""What makes a class a minivllm model: constructor and forward keywords (contract §6.4)."""

import inspect
from collections.abc import Callable
from typing import Any

from minivllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["attn_type", "default_pooling_type", "get_attn_type", "get_default_seq_pooling_type",
           "get_default_tok_pooling_type", "is_pooling_model", "is_vllm_model", "supports_kw"]


def supports_kw(fn: Callable[..., Any] | None, kw_name: str, *, requires_kw_only: bool = False,
                allow_var_kwargs: bool = True) -> bool:
    """True when `fn` can be called with the keyword `kw_name`."""
    if fn is None:
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    param = params.get(kw_name)
    if param is not None:
        kinds = ((inspect.Parameter.KEYWORD_ONLY,) if requires_kw_only else
                 (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
        return param.kind in kinds
    return allow_var_kwargs and any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def is_vllm_model(model: type | object) -> bool:
    """Constructor takes `vllm_config`; forward takes `input_ids` and `positions`."""
    cls = model if isinstance(model, type) else type(model)
    if not supports_kw(cls.__init__, "vllm_config"):
        return False
    if not callable(getattr(cls, "embed_input_ids", None)):
        logger.warning("%s has no embed_input_ids(); inputs_embeds will not be supported.", cls.__name__)
    forward = getattr(cls, "forward", None)
    return supports_kw(forward, "input_ids") and supports_kw(forward, "positions")


def is_pooling_model(model: type | object) -> bool:
    return is_vllm_model(model) and bool(getattr(model, "is_pooling_model", False))


def default_pooling_type(*, seq_pooling_type: str = "LAST", tok_pooling_type: str = "ALL"
                         ) -> Callable[[type], type]:
    """Class decorator: the pooling a pooling model runs when the user sets none (BERT: CLS)."""
    def mark(model: type) -> type:
        model.default_seq_pooling_type = seq_pooling_type
        model.default_tok_pooling_type = tok_pooling_type
        return model
    return mark


def get_default_seq_pooling_type(model: type | object) -> str:
    return getattr(model, "default_seq_pooling_type", "LAST")


def get_default_tok_pooling_type(model: type | object) -> str:
    return getattr(model, "default_tok_pooling_type", "ALL")


def attn_type(kind: str) -> Callable[[type], type]:
    """Class decorator: "decoder" (causal, the default) or "encoder_only" (bidirectional)."""
    valid = ("decoder", "encoder_only")
    if kind not in valid:
        raise ValueError(f"attn_type {kind!r} is not supported; choose one of {valid}")

    def mark(model: type) -> type:
        model.attn_type = kind
        return model
    return mark


def get_attn_type(model: type | object) -> str:
    return getattr(model, "attn_type", "decoder")
