"""The llguidance backend: constraint -> grammar text, validation, and a per-request matcher."""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import llguidance
import torch

from minivllm.logger import init_logger
from minivllm.sampling_params import StructuredOutputsParams

logger = init_logger(__name__)


def grammar_key(params: StructuredOutputsParams) -> str:
    """What the compiled grammar depends on: the constraint and the JSON options (cache key)."""
    spec = getattr(params, params.kind)
    if isinstance(spec, (dict, list)):
        # NOTE: keys keep their order: the grammar writes properties in the schema's order.
        spec = json.dumps(spec)
    return json.dumps([params.kind, spec, params.disable_any_whitespace,
                       params.disable_additional_properties, params.whitespace_pattern])


@functools.lru_cache(maxsize=256)
def _serialize_and_validate(key: str) -> str:
    kind, spec, no_whitespace, no_additional, whitespace_pattern = json.loads(key)
    grammar = _serialize(kind, spec, no_whitespace, no_additional, whitespace_pattern)
    # Without a tokenizer this checks the grammar itself (regex syntax, Lark rules, schema
    # keywords); it is cheap, the token-level work happens when the matcher is built.
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(f"Invalid structured_outputs {kind}: {problem.strip()}")
    return grammar


def serialize_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; raises ValueError naming what is wrong with it."""
    return _serialize_and_validate(grammar_key(params))


def _serialize(kind: str, spec: Any, no_whitespace: bool, no_additional: bool,
               whitespace_pattern: str | None) -> str:
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _load_schema(spec)
        if no_additional:
            schema = _forbid_additional_properties(copy.deepcopy(schema))
        options: dict[str, Any] = {"whitespace_flexible": not no_whitespace}
        if whitespace_pattern is not None:
            options["whitespace_pattern"] = whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        # A Lark alternative of quoted literals (JSON string syntax is Lark's too).
        choice = json.loads(spec) if isinstance(spec, str) else spec
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choice))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec)   # Lark, or GBNF converted to Lark
    if kind == "structural_tag":
        return _structural_tag_grammar(spec)
    raise ValueError(f"structured_outputs {kind} is not supported; use one of json, "
                     "json_object, regex, choice, grammar, structural_tag.")


def _structural_tag_grammar(spec: Any) -> str:
    """vLLM's structural tag, {"structures": [{"begin", "schema", "end"}], "triggers": [...]}:
    free text in which each trigger starts a tagged JSON segment (llguidance's lazy lexemes)."""
    tag = _load_schema(spec) if isinstance(spec, str) else spec
    if not isinstance(tag, dict) or not tag.get("structures") or not tag.get("triggers"):
        raise ValueError("Invalid structured_outputs structural_tag: it needs `structures` "
                         "and `triggers`.")
    tags = []
    for s in tag["structures"]:
        trigger = next((t for t in tag["triggers"] if s.get("begin", "").startswith(t)), None)
        if trigger is None or not trigger:
            raise ValueError(f"Invalid structured_outputs structural_tag: no trigger starts "
                             f"the begin string {s.get('begin')!r}.")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"],
                                         grammar=s.get("schema", {}), end=s.get("end", "")))
    return llguidance.LLMatcher.grammar_from_lark(llguidance.StructTag.to_grammar(tags))


def _load_schema(spec: Any) -> Any:
    if not isinstance(spec, str):
        return spec
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Invalid structured_outputs json: the schema is not valid JSON: "
                         f"{exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise ValueError("Invalid structured_outputs json: a JSON schema is an object or a "
                         f"boolean, got {type(schema).__name__}.")
    return schema


def _forbid_additional_properties(schema: Any) -> Any:
    """Sets additionalProperties: false on every object schema that does not say (OpenAI's
    strict mode); walks nested schemas."""
    if isinstance(schema, dict):
        if schema.get("type") == "object" or "properties" in schema:
            schema.setdefault("additionalProperties", False)
        for value in schema.values():
            _forbid_additional_properties(value)
    elif isinstance(schema, list):
        for value in schema:
            _forbid_additional_properties(value)
    return schema


def make_ll_tokenizer(tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of an HF fast tokenizer (or minivllm's FastTokenizer): its Rust
    tokenizer's JSON, padded to the model's vocabulary (ids past the tokenizer never match)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured outputs need a fast (Rust-backed) tokenizer.")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                  eos_token=tokenizer.eos_token_id)


class GuidanceGrammar:
    """The grammar state of one request: advanced by each sampled token."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advances the state; False (and a warning) when a token breaks the grammar."""
        if self.matcher.consume_tokens(token_ids):
            return True
        logger.warning("Request %s: token ids %s do not fit its grammar: %s", request_id,
                       token_ids, self.matcher.get_error())
        return False

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar accepts in a row from here (state unchanged)."""
        return self.matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (draft positions' masks)."""
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """No token but EOS can follow (the constraint is complete, or the matcher failed)."""
        return self.matcher.is_stopped()


def fill_bitmask(executor: llguidance.LLExecutor, grammars: list[GuidanceGrammar],
                 bitmask: torch.Tensor) -> None:
    """Writes row i of `bitmask` [len(grammars), W] int32 (bit t of word w allows token
    32 * w + t) from grammar i, all rows in one call that releases the GIL."""
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
    executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                     bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
