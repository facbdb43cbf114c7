"""DeepSeek-R1 (and QwQ, R1 distills): `<think>` ... `</think>`; the chat template opens the
reasoning, so output without any tag is reasoning until `</think>`."""

from minivllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from minivllm.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    assume_reasoning = True
