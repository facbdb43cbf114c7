"""config.utils.getattr_iter: one field read under its several spellings."""

import logging
from types import SimpleNamespace

from minivllm.config.utils import getattr_iter


def test_first_present_name_wins() -> None:
    cfg = SimpleNamespace(n_embd=64, hidden_size=128)
    assert getattr_iter(cfg, ["hidden_size", "n_embd"]) == 128
    assert getattr_iter(cfg, ["d_model", "n_embd"]) == 64


def test_defaults() -> None:
    cfg = SimpleNamespace()
    assert getattr_iter(cfg, ["a", "b"]) is None
    assert getattr_iter(cfg, ["a"], default=3) == 3
    made = getattr_iter(cfg, ["a"], default=3, default_factory=list)
    assert made == [] and made is not getattr_iter(cfg, ["a"], default_factory=list)


def test_warn_on_alias(caplog) -> None:
    cfg = SimpleNamespace(n_embd=64)
    with caplog.at_level(logging.WARNING):
        assert getattr_iter(cfg, ["hidden_size", "n_embd"], warn=True) == 64
    assert "n_embd" in caplog.text and "hidden_size" in caplog.text
