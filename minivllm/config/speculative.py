"""vLLM's SpeculativeConfig: which proposer drafts tokens and how many the target verifies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.config.utils import check_config_keys

# Methods minivllm runs; vLLM's others (below) are named in the error so a user knows why.
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Methods whose proposer is a checkpoint of its own (`model`), run beside the target.
DRAFT_CHECKPOINT_METHODS = ("draft_model", "eagle", "eagle3")
_VLLM_ONLY_METHODS = ("medusa", "mlp_speculator", "mtp", "deepseek_mtp", "suffix")
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
# vLLM's default n-gram window when neither bound is given.
_DEFAULT_NGRAM = 5


def _method_from_model_name(model: str) -> str:
    """vLLM's guess when only `model` is given: the n-gram names, an EAGLE head by its name
    ("EAGLE-..." / "...eagle3..."), else a draft model."""
    if model in _NGRAM_MODEL_NAMES:
        return "ngram"
    name = model.lower()
    if "eagle-" in name:
        return "eagle"
    return "eagle3" if "eagle3" in name else "draft_model"


@dataclass
class SpeculativeConfig:
    """`speculative_config={"method": "ngram", "num_speculative_tokens": 4, ...}`.

    n-gram (prompt lookup) drafting: the proposer looks for the longest earlier occurrence (of
    `prompt_lookup_min`..`prompt_lookup_max` tokens) of the sequence's last tokens in its prompt
    and output, and drafts the tokens that followed it. `draft_model`: a smaller checkpoint
    `model` of the same vocabulary drafts greedily (`quantization`: its own, default the
    checkpoint's). `eagle` / `eagle3`: `model` is an EAGLE head (a decoder layer or two fed the
    target's hidden states: its last one, or for EAGLE-3 the ones of a few layers); it drafts
    greedily, a token at a time. Either way the target model checks all the drafts in one step,
    so a step yields between 1 and `num_speculative_tokens` + 1 tokens.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None                # the draft checkpoint; "[ngram]" is vLLM's n-gram
    quantization: str | None = None         # the draft model's
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # vLLM's PARD-style parallel drafting (all drafts in one forward); refused when set.
    parallel_drafting: bool = False
    # Set by EngineArgs for draft_model: the draft's ModelConfig (the target's dtype and length).
    draft_model_config: Any = field(default=None, init=False, repr=False, compare=False)
    # ... and the QuantizationConfig of the draft's checkpoint (None: unquantized).
    draft_quant_config: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.method is None and self.model is not None:
            self.method = _method_from_model_name(self.model)
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
            what = "the draft checkpoint (a folder or a .gguf file)" \
                if self.method == "draft_model" else "the EAGLE head's checkpoint folder"
            raise ValueError(f"speculative_config method {self.method!r} needs `model`: {what}")
        if self.parallel_drafting:
            raise ValueError("speculative_config parallel_drafting is not supported by minivllm; "
                             "drafts are proposed one forward at a time")

    @property
    def use_eagle(self) -> bool:
        """EAGLE or EAGLE-3: the proposer reads the target's hidden states."""
        return self.method in ("eagle", "eagle3")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past a step's tokens that the proposer writes (a draft model's k steps;
        an EAGLE head's k - 1, k reserved as vLLM does)."""
        return self.num_speculative_tokens if self.method in DRAFT_CHECKPOINT_METHODS else 0

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


def check_eagle_head(draft: Any, target: Any, method: str) -> None:
    """An EAGLE head's ModelConfig made ready to build, as vLLM's EAGLE config does: its
    architectures named for the method (`LlamaForCausalLM` -> `EagleLlamaForCausalLM` /
    `Eagle3LlamaForCausalLM`); ValueError when its vocabulary or the hidden size it reads is
    not the target's."""
    mark = "Eagle3" if method == "eagle3" else "Eagle"
    archs = list(getattr(draft.hf_config, "architectures", None) or ["LlamaForCausalLM"])
    draft.hf_config.architectures = [a if a.startswith(mark) or a.endswith("Eagle3")
                                     else mark + a for a in archs]
    if draft.get_vocab_size() != target.get_vocab_size():
        raise ValueError(f"The EAGLE head's vocabulary ({draft.get_vocab_size()} tokens) differs "
                         f"from the target's ({target.get_vocab_size()}); it must be a head "
                         "trained for this target")
    config = draft.hf_config
    reads = getattr(config, "target_hidden_size", None) or config.hidden_size
    if reads != target.hf_text_config.hidden_size:
        raise ValueError(f"The EAGLE head reads hidden states of size {reads}, the target's are "
                         f"{target.hf_text_config.hidden_size}; it must be a head trained for "
                         "this target")
