"""PoolerConfig: how a pooling model turns hidden states into one output per sequence.

Resolved once per engine, in vLLM's order: the user's `pooler_config` (`--pooler-config`) wins,
then a sentence-transformers checkpoint's own files (`modules.json` + `<n>_Pooling/config.json`),
then the model's default (the HF config's `pooling` field, else LAST), normalised unless told not.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from minivllm.config.utils import check_config_keys

SEQ_POOLING_TYPES = ("LAST", "MEAN", "CLS")   # one vector per sequence
TOK_POOLING_TYPES = ("ALL",)                  # one vector per token
POOLING_TYPES = SEQ_POOLING_TYPES + TOK_POOLING_TYPES
# sentence-transformers' `pooling_mode_*` flags -> pooling type
_ST_POOLING_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
                     "pooling_mode_lasttoken": "LAST"}
# HF `pooling` field (e.g. LlamaBidirectionalConfig) -> pooling type
_HF_POOLING = {"avg": "MEAN", "mean": "MEAN", "cls": "CLS", "last": "LAST"}


@dataclass
class PoolerConfig:
    """vLLM's fields; `pooling_type` fills `seq_pooling_type` or `tok_pooling_type`."""

    pooling_type: str | None = None
    seq_pooling_type: str | None = None
    tok_pooling_type: str | None = None
    normalize: bool | None = None      # L2-normalise embeddings (default True)
    dimensions: int | None = None      # default output size of a matryoshka model

    def __post_init__(self) -> None:
        for name, valid in (("pooling_type", POOLING_TYPES), ("seq_pooling_type", SEQ_POOLING_TYPES),
                            ("tok_pooling_type", TOK_POOLING_TYPES)):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or value.upper() not in valid:
                raise ValueError(f"pooler_config {name}={value!r} is not supported; choose one "
                                 f"of {', '.join(valid)}")
            setattr(self, name, value.upper())
        if self.pooling_type is not None:
            field = "tok_pooling_type" if self.pooling_type in TOK_POOLING_TYPES else "seq_pooling_type"
            if getattr(self, field) is None:
                setattr(self, field, self.pooling_type)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"pooler_config dimensions must be a positive int, got {self.dimensions!r}")

    @property
    def effective_pooling_type(self) -> str | None:
        """The one pooling the engine runs (a token-wise type, when given, wins)."""
        return self.tok_pooling_type or self.seq_pooling_type

    def get_seq_pooling_type(self) -> str:
        """vLLM's accessor: the sequence pooling a model file's sequence pooler runs."""
        return self.seq_pooling_type or "LAST"

    def get_tok_pooling_type(self) -> str:
        """vLLM's accessor: the token pooling a model file's token pooler runs."""
        return self.tok_pooling_type or "ALL"

    @classmethod
    def parse(cls, value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig | None:
        """A PoolerConfig from itself, a dict, or JSON text (`--pooler-config`); unknown keys
        are a ValueError naming the valid ones."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"pooler_config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("pooler_config must be a JSON object such as "
                             '\'{"pooling_type": "MEAN", "normalize": false}\'')
        check_config_keys(cls, value, "pooler_config")
        return cls(**value)


def sentence_transformers_pooling(model_path: str) -> dict[str, Any] | None:
    """`{"pooling_type": ..., "normalize": ...}` from a sentence-transformers folder, else None.

    `modules.json` lists the pipeline; its Pooling module's folder holds `config.json` with
    `pooling_mode_*` flags, and a Normalize module means the output is L2-normalised.
    """
    modules_file = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file) as f:
        modules = json.load(f)
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    found: dict[str, Any] = {"normalize": "Normalize" in types}
    pooling = types.get("Pooling")
    config_file = os.path.join(model_path, pooling.get("path", ""), "config.json") if pooling else ""
    if pooling is not None and os.path.isfile(config_file):
        with open(config_file) as f:
            flags = json.load(f)
        for flag, pooling_type in _ST_POOLING_MODES.items():
            if flags.get(flag):
                found["pooling_type"] = pooling_type
                break
    return found


def resolve_pooler_config(user: PoolerConfig | dict[str, Any] | str | None, model_path: str,
                          hf_config: Any, model_default: str = "LAST") -> PoolerConfig:
    """Every field set: the user's, else the checkpoint's sentence-transformers files, else the
    model's default (HF `pooling`, else the model class's `model_default`; normalised)."""
    resolved = PoolerConfig.parse(user) or PoolerConfig()
    st = sentence_transformers_pooling(model_path) if os.path.isdir(model_path) else None
    hf_pooling = getattr(hf_config, "pooling", None)
    default_type = (_HF_POOLING.get(str(hf_pooling).lower(), model_default) if hf_pooling
                    else model_default)
    if resolved.effective_pooling_type is None:
        resolved = dataclasses.replace(resolved, pooling_type=(st or {}).get("pooling_type") or default_type)
    if resolved.normalize is None:
        resolved.normalize = bool(st["normalize"]) if st is not None else True
    return resolved
