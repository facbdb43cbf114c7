"""vLLM's SpeculativeConfig: which proposer drafts tokens and how many the target verifies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.config.utils import check_config_keys

# Methods minivllm runs; vLLM's others (below) are named in the error so a user knows why.
SPECULATIVE_METHODS = ("ngram", "draft_model")
_VLLM_ONLY_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp",
                      "suffix")
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
# vLLM's default n-gram window when neither bound is given.
_DEFAULT_NGRAM = 5


@dataclass
class SpeculativeConfig:
    """`speculative_config={"method": "ngram", "num_speculative_tokens": 4, ...}`.

    n-gram (prompt lookup) drafting: the proposer looks for the longest earlier occurrence (of
    `prompt_lookup_min`..`prompt_lookup_max` tokens) of the sequence's last tokens in its prompt
    and output, and drafts the tokens that followed it. `draft_model`: a smaller checkpoint
    `model` of the same vocabulary drafts greedily (`quantization`: its own, default the
    checkpoint's). Either way the target model checks all the drafts in one step, so a step
    yields between 1 and `num_speculative_tokens` + 1 tokens.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None                # the draft checkpoint; "[ngram]" is vLLM's n-gram
    quantization: str | None = None         # the draft model's
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # Set by EngineArgs for draft_model: the draft's ModelConfig (the target's dtype and length).
    draft_model_config: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.method is None and self.model is not None:
            self.method = "ngram" if self.model in _NGRAM_MODEL_NAMES else "draft_model"
        if self.method is None:
            raise ValueError("speculative_config needs a method (or a draft model); supported: "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if self.method not in SPECULATIVE_METHODS:
            why = ("is not supported by minivllm" if self.method in _VLLM_ONLY_METHODS
                   else "is not a speculative decoding method")
            raise ValueError(f"speculative_config method {self.method!r} {why}; supported: "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        n = self.num_speculative_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError("speculative_config num_speculative_tokens must be a positive "
                             f"integer, got {n!r}")
        if self.method == "ngram":
            self._check_ngram_window()
        elif not self.model or self.model in _NGRAM_MODEL_NAMES:
            raise ValueError("speculative_config method 'draft_model' needs `model`: the draft "
                             "checkpoint (a folder or a .gguf file)")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past a step's tokens that the proposer writes (a draft model's k steps)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    def _check_ngram_window(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"speculative_config {name} must be a positive integer, "
                                 f"got {value!r}")
        if lo is None and hi is None:
            lo = hi = _DEFAULT_NGRAM
        lo = hi if lo is None else lo     # one bound given: a window of that one length
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must not exceed "
                             f"prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """From `speculative_config` as given to LLM(...) or --speculative-config; an unknown
        key is a ValueError naming the valid ones."""
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {values!r}")
        check_config_keys(cls, values, "speculative_config")
        return cls(**values)
