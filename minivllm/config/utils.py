"""Helpers vLLM's model files use to read configs (vLLM's `config.utils`)."""

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
