"""General plugins (vLLM's `vllm.general_plugins`): entry points run once in every process.

A plugin package declares, in its pyproject.toml,

    [project.entry-points."minivllm.general_plugins"]
    my_models = "my_pkg:register"

and `register()` calls `ModelRegistry.register_model("MyArch", "my_pkg.model:MyForCausalLM")`.
The engine (`EngineArgs.create_engine_config`), every worker rank (`worker_proc`), the server and
`check-model` call `load_general_plugins()` before they resolve a model, so a model registered
by a plugin works with TP/PP. `VLLM_PLUGINS="a,b"` loads only the named ones. Plugins must be
idempotent: they run in each process, and a re-registration overwrites the entry.
"""

import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from minivllm.logger import init_logger

logger = init_logger(__name__)

DEFAULT_PLUGINS_GROUP = "minivllm.general_plugins"

__all__ = ["DEFAULT_PLUGINS_GROUP", "load_general_plugins", "load_plugins_by_group"]

_plugins_loaded = False


def load_plugins_by_group(group: str) -> dict[str, Callable[[], Any]]:
    """The entry points of `group` (only those named in VLLM_PLUGINS when it is set), loaded."""
    allowed = os.environ.get("VLLM_PLUGINS")   # vLLM's variable: a process-start choice
    names = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    plugins: dict[str, Callable[[], Any]] = {}
    for plugin in entry_points(group=group):
        if names is not None and plugin.name not in names:
            continue
        try:
            plugins[plugin.name] = plugin.load()
        except Exception:
            logger.exception("Failed to load plugin %s (%s)", plugin.name, plugin.value)
    if plugins:
        logger.info("Plugins loaded from %s: %s", group, ", ".join(sorted(plugins)))
    return plugins


def load_general_plugins() -> None:
    """Run every general plugin once in this process (later calls return at once)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for name, func in load_plugins_by_group(DEFAULT_PLUGINS_GROUP).items():
        try:
            func()
        except Exception:
            logger.exception("General plugin %s failed", name)
