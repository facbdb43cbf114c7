"""Text checks on decoded JSON values."""

from typing import Any


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) that is not encodable as UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    nested = (str, list, dict)   # ints and floats (token-id prompts) are skipped cheaply
    if isinstance(value, dict):
        items = [(path, k) for k in value if isinstance(k, str)]   # keys first, then values
        items += [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()
                  if isinstance(v, nested)]
    elif isinstance(value, list):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value) if isinstance(v, nested)]
    else:
        return None
    return next((found for p, v in items if (found := lone_surrogate_path(v, p)) is not None),
                None)
