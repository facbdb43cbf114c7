"""Sampling parameters of one request, with vLLM's names, defaults and validation."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from minivllm.inputs import check_truncate_prompt_tokens

MAX_LOGPROBS = 20   # as vLLM's default max_logprobs
# Temperatures below this are treated as greedy decoding (vLLM's threshold).
_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what each output of a streamed request holds (`AsyncLLM.generate`): all text
    and tokens so far, only those new since the previous output, or one final output.
    `LLM.generate` returns final outputs whatever the kind."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's names): a JSON schema, any JSON object, a regex, one of
    some strings, or an EBNF / Lark grammar. The grammar library enforces it token by token."""

    json: str | dict | None = None        # a JSON schema (text or dict)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None            # Lark or GBNF / EBNF
    json_object: bool | None = None       # any JSON object
    structural_tag: str | None = None     # {"structures": [{begin, schema, end}], "triggers"}
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens
    disable_additional_properties: bool = False   # objects get additionalProperties: false
    disable_fallback: bool = False        # accepted for compatibility: there is one backend
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINT_KINDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one constraint of "
                f"{', '.join(_CONSTRAINT_KINDS)}; got {', '.join(given) if given else 'none'}.")
        for name, types in _FIELD_TYPES.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, types):
                raise ValueError(f"structured_outputs {name} must be "
                                 f"{' or '.join(_TYPE_NAMES[t] for t in types)}, "
                                 f"not {type(value).__name__}.")
        if self.json_object is False:
            raise ValueError("structured_outputs json_object must be true when given.")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs choice must be a non-empty list of strings.")

    @property
    def kind(self) -> str:
        """The constraint given: 'json', 'regex', 'choice', 'grammar', ..."""
        return next(name for name in _CONSTRAINT_KINDS if getattr(self, name) is not None)


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# The types each field takes (a server request's JSON gives any): the grammar library's calls
# raise TypeError on others.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "json": (str, dict), "regex": (str,), "choice": (list,), "grammar": (str,),
    "json_object": (bool,), "structural_tag": (str,), "disable_any_whitespace": (bool,),
    "disable_additional_properties": (bool,), "disable_fallback": (bool,),
    "whitespace_pattern": (str,)}
_TYPE_NAMES = {str: "a string", dict: "an object", list: "a list", bool: "a boolean"}


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_int_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(map(_is_int, v))


# SamplingParams' fields by type: (names, check, what the error calls it); `_OPTIONAL` ones may
# be None. A wrong type otherwise failed later, in the engine's thread (seed=1.5: a RuntimeError
# from torch's manual_seed mid-step) or silently (stop_token_ids=["a"]).
_TYPE_RULES = (
    (("n", "top_k", "min_tokens", "best_of", "seed", "max_tokens", "logprobs",
      "prompt_logprobs", "truncate_prompt_tokens"), _is_int, "an integer"),
    (("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
      "min_p"), _is_real, "a number"),
    (("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
      "include_stop_str_in_output", "detokenize"), lambda v: isinstance(v, bool), "a boolean"),
    (("stop",), lambda v: isinstance(v, str) or (isinstance(v, (list, tuple)) and all(
        isinstance(s, str) for s in v)), "a string or a list of strings"),
    (("stop_token_ids", "allowed_token_ids"), _is_int_list, "a list of token ids"),
    (("bad_words",), lambda v: isinstance(v, (list, tuple)), "a list of strings"),
    (("logit_bias",), lambda v: isinstance(v, dict) and all(map(_is_real, v.values())),
     "a dict of token id -> bias"),
    (("extra_args",), lambda v: isinstance(v, dict), "a dict"),
)
_OPTIONAL = frozenset({"best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs", "stop",
                       "stop_token_ids", "allowed_token_ids", "bad_words", "logit_bias",
                       "truncate_prompt_tokens", "extra_args"})


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt (see vLLM's `SamplingParams`)."""

    n: int = 1                            # completions per prompt
    best_of: int | None = None            # accepted for compatibility, ignored
    presence_penalty: float = 0.0         # in [-2, 2]; on tokens present in the output
    frequency_penalty: float = 0.0        # in [-2, 2]; times the count in the output
    repetition_penalty: float = 1.0       # > 0; on prompt and output tokens, 1 = off
    temperature: float = 1.0              # 0 = greedy
    top_p: float = 1.0                    # in (0, 1]
    top_k: int = 0                        # 0 or -1 = off (-1 is normalised to 0)
    min_p: float = 0.0                    # in [0, 1]
    seed: int | None = None               # per-request generator when set
    stop: str | list[str] | None = None   # normalised to list[str]
    stop_token_ids: list[int] | None = None   # normalised to list[int]
    ignore_eos: bool = False
    max_tokens: int | None = 16           # None = until max_model_len
    min_tokens: int = 0                   # eos / stop ids are masked until reached
    logprobs: int | None = None           # number of top logprobs per generated token
    prompt_logprobs: int | None = None    # number of top logprobs per prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # token id -> bias added to its logit (OpenAI's logit_bias; -100 bans, +100 forces)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None   # sample only among these (vLLM's extra)
    bad_words: list[str] | None = None   # never generated (vLLM's extra; see update_from_tokenizer)
    structured_outputs: StructuredOutputsParams | None = None
    # keep only the prompt's last k tokens (-1: the last max_model_len), as vLLM
    truncate_prompt_tokens: int | None = None
    # vLLM's: free-form settings for custom logits processors (v1/sample/logits_processor)
    extra_args: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # stop_token_ids plus the model's eos (unless ignore_eos): what min_tokens masks.
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False, compare=False)
    # bad_words as token-id sequences (update_from_tokenizer)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False,
                                                  compare=False)

    def __post_init__(self) -> None:
        self._check_types()
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._all_stop_token_ids = set(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            try:
                self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers, or integers as "
                                 "strings).") from None
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # NOTE: greedy ignores the truncation knobs; resetting them keeps
            # the sampler from doing useless work on greedy rows.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_types(self) -> None:
        """ValueError naming the first field of the wrong type (numpy / torch scalars count as
        the Python ones); the value checks below assume the right types."""
        for names, ok, kind in _TYPE_RULES:
            for name in names:
                value = getattr(self, name)
                if value is None and name in _OPTIONAL:
                    continue
                if not ok(value):
                    raise ValueError(f"{name} must be {kind}"
                                     f"{' or None' if name in _OPTIONAL else ''}, got "
                                     f"{type(value).__name__} {value!r}.")
                if ok is _is_int:
                    setattr(self, name, int(value))   # numpy / torch ints -> int
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError("output_kind must be a RequestOutputKind (CUMULATIVE, DELTA, "
                             f"FINAL_ONLY), got {self.output_kind!r}.") from None
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or None, got "
                             f"{type(self.structured_outputs).__name__}.")

    def _verify_args(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative or None, got {value}.")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True; "
                             "use stop_token_ids instead.")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty.")
        if self.bad_words is not None and not all(
                isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-blank strings.")
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0 or not math.isfinite(bias):
                raise ValueError(f"logit_bias needs token ids >= 0 and finite biases, got "
                                 f"{token_id}: {bias}.")

    def verify_logprobs(self, max_logprobs: int) -> None:
        """logprobs and prompt_logprobs within the engine's max_logprobs (checked by it)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"Requested {name} of {value}, more than this engine allows "
                                 f"({max_logprobs}); start it with a larger --max-logprobs "
                                 "(max_logprobs; -1: the vocabulary size).")

    def verify_vocab(self, vocab_size: int) -> None:
        """Token ids the params name must be in [0, vocab_size) (checked by the engine)."""
        for name, ids in (("logit_bias", self.logit_bias or {}),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} token id {bad[0]} is out of range: ids must be in "
                                 f"[0, {vocab_size}).")

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenises bad_words (called by the engine on its own copy of the params).

        As vLLM: each word is encoded as written (without leading spaces) and with one leading
        space; the spaced form is kept too when it is a different word token of the same length
        (a word inside the text is usually another token than at its start).
        """
        if not self.bad_words:
            return
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer.")
        sequences: list[list[int]] = []
        for word in self.bad_words:
            bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            sequences.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        self._bad_words_token_ids = [ids for ids in sequences if ids]

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """bad_words as token-id sequences; empty until update_from_tokenizer."""
        return self._bad_words_token_ids

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def update_from_eos_token_id(self, eos_token_id: int | None) -> None:
        """Called by the engine on its own copy of the params, so min_tokens also masks eos."""
        if eos_token_id is not None and not self.ignore_eos:
            self._all_stop_token_ids.add(eos_token_id)

    def update_from_generation_config(self, generation_config: dict[str, Any],
                                      model_eos_token_id: int | None = None) -> None:
        """vLLM's: the model's eos, then the generation config's other eos ids (Llama 3's
        <|eom_id|>, Qwen's <|endoftext|>, ...) as stop tokens, unless ignore_eos."""
        self.update_from_eos_token_id(model_eos_token_id)
        eos = generation_config.get("eos_token_id")
        extra = ({eos} if isinstance(eos, int) else set(eos or ())) - {model_eos_token_id}
        if extra:
            self._all_stop_token_ids.update(extra)
            if not self.ignore_eos:
                self.stop_token_ids = [*self.stop_token_ids,
                                       *sorted(extra - set(self.stop_token_ids))]


@dataclass
class BeamSearchParams:
    """`LLM.beam_search`'s parameters (vLLM's names and defaults). Each step takes the top
    2 x beam_width logprobs of every beam, so beam_width is at most MAX_LOGPROBS / 2."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.beam_width > MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be at most {MAX_LOGPROBS // 2} (each step reads "
                             f"2 x beam_width logprobs, at most {MAX_LOGPROBS}), got "
                             f"{self.beam_width}.")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
