"""Logging set-up: `init_logger(__name__)` as in vLLM."""

import logging
import os

_FMT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
_root = logging.getLogger("minivllm")
if not _root.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter(_FMT, datefmt="%H:%M:%S"))
    _root.addHandler(_handler)
    _root.setLevel(os.environ.get("MINIVLLM_LOGGING_LEVEL", "WARNING").upper())
    _root.propagate = False


def init_logger(name: str) -> logging.Logger:
    """Return a logger under the `minivllm` hierarchy."""
    if not name.startswith("minivllm"):
        name = f"minivllm.{name}"
    return logging.getLogger(name)
