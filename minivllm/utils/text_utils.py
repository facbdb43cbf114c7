"""Text helpers for streams that must not show a marker before it is complete."""


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (a stop string,
    a tool-call or reasoning tag): a stream holds them back until the next text decides."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
