"""PEFTHelper: what an adapter's `adapter_config.json` says, validated (vLLM's `lora/peft_helper.py`).

A PEFT LoRA layer computes `base(x) + B(A(x)) * scaling` with A `[r, in]`, B `[out, r]` and
`scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`). `rank_pattern` and
`alpha_pattern` override `r` and `lora_alpha` for the modules whose name ends with their key.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from minivllm.config.lora import LoRAConfig

ADAPTER_CONFIG = "adapter_config.json"
_SUPPORTED_BIAS = ("none",)


def _rank(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# The JSON types a config's fields must have (a hand-edited or foreign config can hold any).
_FIELD_TYPES = {
    "r": (_rank, "a positive integer"),
    "lora_alpha": (_number, "a number"),
    "target_modules": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(
        isinstance(t, str) for t in v)), "a regex string or a list of module names"),
    "rank_pattern": (lambda v: isinstance(v, dict) and all(map(_rank, v.values())),
                     "an object of positive integers"),
    "alpha_pattern": (lambda v: isinstance(v, dict) and all(map(_number, v.values())),
                      "an object of numbers"),
}


@dataclass
class PEFTHelper:
    r: int
    lora_alpha: float
    target_modules: list[str] | str
    bias: str = "none"
    use_rslora: bool = False
    use_dora: bool = False
    modules_to_save: list[str] | None = None
    fan_in_fan_out: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    peft_type: str = "LORA"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> PEFTHelper:
        if not isinstance(config, dict):
            raise ValueError(f"{ADAPTER_CONFIG} must hold a JSON object, not "
                             f"{type(config).__name__}")
        names = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in config.items() if k in names and v is not None}
        for key in ("r", "lora_alpha", "target_modules"):
            if key not in kwargs:
                raise ValueError(f"{ADAPTER_CONFIG} has no {key!r}; a PEFT LoRA config needs "
                                 "r, lora_alpha and target_modules")
        for key, (ok, kind) in _FIELD_TYPES.items():
            if key in kwargs and not ok(kwargs[key]):
                raise ValueError(f"{ADAPTER_CONFIG}: {key} must be {kind}, not {kwargs[key]!r}")
        if isinstance(kwargs["target_modules"], (list, tuple, set)):
            kwargs["target_modules"] = sorted(kwargs["target_modules"])
        return cls(**kwargs)

    @classmethod
    def from_local_dir(cls, lora_path: str) -> PEFTHelper:
        config_file = os.path.join(lora_path, ADAPTER_CONFIG)
        if not os.path.isfile(config_file):
            raise ValueError(f"No {ADAPTER_CONFIG} in LoRA adapter folder {lora_path!r}"
                             + ("" if os.path.isdir(lora_path) else " (no such folder)"))
        with open(config_file) as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
        return cls.from_dict(config)

    def validate(self, lora_config: LoRAConfig) -> None:
        """Refuse what the LoRA layers cannot compute, naming the supported choices."""
        if str(self.peft_type).upper() != "LORA":
            raise ValueError(f"peft_type {self.peft_type!r} is not supported; only LORA adapters")
        if self.bias not in _SUPPORTED_BIAS:
            raise ValueError(f"LoRA bias={self.bias!r} is not supported (it trains the base "
                             f"layers' biases); supported: {', '.join(_SUPPORTED_BIAS)}")
        if self.modules_to_save:
            raise ValueError(f"modules_to_save={list(self.modules_to_save)} is not supported: "
                             "fully trained modules cannot be swapped per request; merge them "
                             "into the base model instead")
        if self.use_dora:
            raise ValueError("use_dora=True (DoRA) is not supported; only plain LoRA adapters")
        if self.fan_in_fan_out:
            raise ValueError("fan_in_fan_out=True (Conv1D weights) is not supported")
        max_rank = max([self.r, *self.rank_pattern.values()])
        if max_rank > lora_config.max_lora_rank:
            raise ValueError(f"LoRA rank {max_rank} is greater than max_lora_rank "
                             f"{lora_config.max_lora_rank}; raise --max-lora-rank")

    def _pattern_value(self, pattern: dict[str, Any], module_name: str, default: Any) -> Any:
        # PEFT's rule: the first key that matches the end of the module's dotted name.
        for key, value in pattern.items():
            if re.match(rf"(.*\.)?{key}$", module_name):
                return value
        return default

    def scaling(self, module_name: str) -> float:
        """`alpha / r` (or `alpha / sqrt(r)`) for the HF-side module name (e.g. `...q_proj`)."""
        r = self._pattern_value(self.rank_pattern, module_name, self.r)
        alpha = self._pattern_value(self.alpha_pattern, module_name, self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module_name: str) -> bool:
        """PEFT's matching: a regex string must match the whole name; a list entry must equal
        the name or its dotted suffix."""
        if isinstance(self.target_modules, str):
            if self.target_modules == "all-linear":
                return True
            return re.fullmatch(self.target_modules, module_name) is not None
        return any(module_name == t or module_name.endswith("." + t) for t in self.target_modules)
