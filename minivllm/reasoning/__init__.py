"""Reasoning parsers (vLLM's `--reasoning-parser` names): reasoning and content of a model's
text, and when its reasoning ends (structured outputs apply from there)."""

from minivllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
from minivllm.reasoning.basic_parsers import BaseThinkingReasoningParser
from minivllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from minivllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = ["BaseThinkingReasoningParser", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser",
           "ReasoningParser", "ReasoningParserManager", "get_reasoning_parser",
           "reasoning_parser_for"]


def get_reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The parser `name` for this tokenizer; ValueError naming the known ones or the missing
    tag tokens."""
    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer)


def reasoning_parser_for(vllm_config, tokenizer) -> ReasoningParser | None:
    """The engine's --reasoning-parser (its StructuredOutputsConfig) for this tokenizer; None
    without one."""
    config = getattr(vllm_config, "structured_outputs_config", None)
    name = getattr(config, "reasoning_parser", "")
    return get_reasoning_parser(name, tokenizer) if name else None
