"""Tool calls written as blocks between a start and an end marker (hermes, qwen3_coder, glm45,
deepseek, kimi_k2, jamba, ...): the text around the blocks is content.

A subclass names its markers and reads one block's body (`parse_block`); this base finds the
blocks, keeps malformed or unterminated ones as content and, while streaming, stops the content
before anything that may still become a marker, so content and calls only ever grow.
"""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (ParsedToolCall,
                                                                           ToolParser)
from minivllm.utils.text_utils import held_back


class BlockToolParser(ToolParser):
    START = ""
    END = ""
    # (begin, end) markers some models put around all of an answer's calls (deepseek, kimi_k2):
    # they are dropped from content, as is whitespace between the calls inside them.
    SECTION: tuple[str, str] | None = None

    def parse_block(self, body: str,
                    tools: list[dict[str, Any]] | None) -> list[ParsedToolCall] | None:
        """The calls of the text between START and END; None when it is no valid call (the
        block then stays content)."""
        raise NotImplementedError

    def parse(self, text: str, final: bool,
              tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ParsedToolCall]]:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        pos, in_section = 0, False
        while True:
            marker, at = self._next_marker(text, pos)
            if at < 0:
                tail = text[pos:]
                if not final:   # the tail may end in the first characters of a marker
                    tail = tail[:len(tail) - max(held_back(tail, m) for m in self._markers())]
                content.append(_gap(tail, in_section))
                break
            content.append(_gap(text[pos:at], in_section))
            if marker != self.START:   # a section marker
                in_section = marker == self.SECTION[0]
                pos = at + len(marker)
                continue
            end = text.find(self.END, at + len(self.START))
            if end < 0:
                if final:   # an unterminated block: the text stays content
                    content.append(text[at:])
                break
            parsed = self.parse_block(text[at + len(self.START):end], tools)
            if parsed is None:
                content.append(text[at:end + len(self.END)])
            else:
                calls.extend(parsed)
            pos = end + len(self.END)
        return "".join(content), calls

    def _markers(self) -> tuple[str, ...]:
        return (self.START, *(self.SECTION or ()))

    def _next_marker(self, text: str, pos: int) -> tuple[str, int]:
        """The first marker at or after `pos` and where it starts; ("", -1) when none is."""
        found = [(at, marker) for marker in self._markers() if (at := text.find(marker, pos)) >= 0]
        if not found:
            return "", -1
        at, marker = min(found)
        return marker, at


def _gap(text: str, in_section: bool) -> str:
    # Inside a section, whitespace between calls is layout, not something the model said.
    return "" if in_section and not text.strip() else text
