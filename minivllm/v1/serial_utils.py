"""How a worker rank runs a `collective_rpc` call (vLLM's `run_method`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check_method(method: Any) -> None:
    """ValueError unless `method` is a worker method's name or a function."""
    if not isinstance(method, str) and not callable(method):
        raise ValueError("collective_rpc needs a worker method's name or a function taking the "
                         f"worker first, got {type(method).__name__}.")


def run_method(obj: Any, method: str | Callable[..., Any], args: tuple = (),
               kwargs: dict[str, Any] | None = None) -> Any:
    """`obj.method(*args, **kwargs)` for a name, else `method(obj, *args, **kwargs)`."""
    check_method(method)
    if isinstance(method, str):
        func = getattr(obj, method, None)
        if not callable(func):
            raise ValueError(f"The worker has no method {method!r}.")
        return func(*args, **(kwargs or {}))
    return method(obj, *args, **(kwargs or {}))
