"""The structured-output state of one engine request: its compiling grammar, then its matcher."""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future

from minivllm.sampling_params import StructuredOutputsParams
from minivllm.v1.structured_output.backend_guidance import GuidanceGrammar


class StructuredOutputRequest:
    """Waits on the shared compiled grammar, then holds this request's own copy of it."""

    def __init__(self, params: StructuredOutputsParams, compiled: Future) -> None:
        self.params = params
        self._compiled = compiled          # Future[llguidance.LLMatcher], shared by the cache
        self._grammar: GuidanceGrammar | None = None
        # With a reasoning parser: the grammar applies once this token ends the reasoning.
        self.reasoning_ended = True
        self.reasoning_end_token_id: int | None = None

    def is_ready(self) -> bool:
        """True once compilation finished (successfully or not)."""
        return self._grammar is not None or self._compiled.done()

    def wait(self, timeout_s: float) -> None:
        """Blocks until compilation finishes or `timeout_s` passes (an idle engine's pause)."""
        concurrent.futures.wait([self._compiled], timeout=timeout_s)

    @property
    def grammar(self) -> GuidanceGrammar:
        """This request's grammar state; raises ValueError when compilation failed."""
        if self._grammar is None:
            template = self._compiled.result()   # re-raises a compilation error
            # Each request (and each of n children) advances its own copy of the fresh state.
            self._grammar = GuidanceGrammar(template.deep_copy())
        return self._grammar
