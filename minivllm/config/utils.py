"""Helpers vLLM's model files use to read configs (vLLM's `config.utils`)."""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from minivllm.logger import init_logger

logger = init_logger(__name__)


def getattr_iter(object: object, names: Sequence[str], default: Any | None = None,
                 default_factory: Callable[[], Any] | None = None, warn: bool = False) -> Any:
    """The first of `names` that `object` has (configs spell one field several ways), else
    `default_factory()` or `default`. With `warn`, names after the first are deprecated aliases
    and using one is logged."""
    for i, name in enumerate(names):
        if hasattr(object, name):
            if warn and i:
                logger.warning("%s uses the deprecated field %r; the preferred name is %r",
                               type(object).__name__, name, names[0])
            return getattr(object, name)
    return default_factory() if default_factory is not None else default


def check_config_keys(config_cls: type, values: dict[str, Any], what: str) -> None:
    """A ValueError naming the valid keys when `values` (a user's JSON object for the
    dataclass `config_cls`, called `what`) has keys the dataclass does not take."""
    names = [f.name for f in dataclasses.fields(config_cls) if f.init]   # in field order
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"Unknown {what} key(s) {unknown}; valid keys: {', '.join(names)}")
