"""Tool-call parsers (vLLM's `--tool-call-parser` names): model text -> content and tool calls."""

from __future__ import annotations

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCall, ToolParser, check_tools, tool_choice_mode, tool_choice_schema)
from minivllm.entrypoints.openai.tool_parsers.block_tool_parser import BlockToolParser
from minivllm.entrypoints.openai.tool_parsers.deepseek_tool_parser import (DeepSeekV3ToolParser,
                                                                           DeepSeekV31ToolParser)
from minivllm.entrypoints.openai.tool_parsers.glm4_moe_tool_parser import Glm45ToolParser
from minivllm.entrypoints.openai.tool_parsers.granite_tool_parser import GraniteToolParser
from minivllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from minivllm.entrypoints.openai.tool_parsers.internlm2_tool_parser import InternLM2ToolParser
from minivllm.entrypoints.openai.tool_parsers.jamba_tool_parser import (JambaToolParser,
                                                                        MinimaxToolParser)
from minivllm.entrypoints.openai.tool_parsers.kimi_k2_tool_parser import KimiK2ToolParser
from minivllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from minivllm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from minivllm.entrypoints.openai.tool_parsers.phi4mini_tool_parser import Phi4MiniJsonToolParser
from minivllm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser
from minivllm.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import (Qwen3CoderToolParser,
                                                                             SeedOssToolParser)
from minivllm.entrypoints.openai.tool_parsers.xlam_tool_parser import XLAMToolParser

__all__ = ["BlockToolParser", "DeepSeekV31ToolParser", "DeepSeekV3ToolParser", "Glm45ToolParser",
           "GraniteToolParser", "Hermes2ProToolParser", "InternLM2ToolParser", "JambaToolParser",
           "KimiK2ToolParser", "Llama3JsonToolParser", "MinimaxToolParser", "MistralToolParser",
           "ParsedToolCall", "Phi4MiniJsonToolParser", "PythonicToolParser",
           "Qwen3CoderToolParser", "SeedOssToolParser", "TOOL_PARSER_NAMES", "ToolParser",
           "XLAMToolParser", "check_tools", "get_tool_parser", "tool_choice_mode",
           "tool_choice_schema"]

_TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "glm45": Glm45ToolParser,
    "granite": GraniteToolParser,
    "hermes": Hermes2ProToolParser,
    "hunyuan_a13b": JambaToolParser,   # the same `<tool_calls>[...]</tool_calls>` format
    "internlm": InternLM2ToolParser,
    "jamba": JambaToolParser,
    "kimi_k2": KimiK2ToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "llama4_pythonic": PythonicToolParser,
    "minimax": MinimaxToolParser,
    "mistral": MistralToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "seed_oss": SeedOssToolParser,
    "xlam": XLAMToolParser,
}
TOOL_PARSER_NAMES = sorted(_TOOL_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    if name not in _TOOL_PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(sorted(_TOOL_PARSERS))}.")
    return _TOOL_PARSERS[name]()
