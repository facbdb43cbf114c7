"""InternLM 2 / 2.5 (`internlm`): `<|action_start|><|plugin|>{"name": ..., "parameters": {...}}
<|action_end|>` blocks (special tokens, kept by decoding with `skip_special_tokens = False`).
`<|action_start|><|interpreter|>` code blocks are not tool calls and stay content."""

from __future__ import annotations

from minivllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser


class InternLM2ToolParser(Hermes2ProToolParser):
    """Hermes' JSON body between InternLM's plugin markers."""

    skip_special_tokens = False
    START, END = "<|action_start|><|plugin|>", "<|action_end|>"
