"""vLLM's `vllm.utils.import_utils`: objects named by their import path."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_obj_by_qualname(qualname: str) -> Any:
    """The object "pkg.module:Class" or "pkg.module.Class" names (nested attributes too).
    ImportError / AttributeError when it does not load, ValueError for a malformed name."""
    if not isinstance(qualname, str) or not qualname.strip(".:"):
        raise ValueError(f"expected 'module:Class' or 'module.Class', got {qualname!r}")
    module_name, _, attrs = qualname.partition(":") if ":" in qualname else qualname.rpartition(".")
    if not module_name or not attrs:
        raise ValueError(f"expected 'module:Class' or 'module.Class', got {qualname!r}")
    obj = importlib.import_module(module_name)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj
