"""Qwen3 (and SmolLM3-style templates): `<think>` ... `</think>`, written by the model or opened
by the template; output without a start tag is plain content (`enable_thinking: false` closes an
empty block in the prompt)."""

from minivllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from minivllm.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    assume_reasoning = False
