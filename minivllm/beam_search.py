"""Beam search for the offline `LLM.beam_search` (vLLM's `vllm.beam_search` names).

Each step asks the engine for one token of every live beam with the top 2 x beam_width
logprobs, as separate requests whose prompt is the beam's tokens so far (prefix caching serves
the shared part: only the block the beam last grew is computed again). Every live beam's
candidates (beam + one of its top tokens) are ranked by `get_beam_search_score` and the best
beam_width survive; a candidate ending in eos is complete. After max_tokens steps (or when no
beam is live) the complete and live beams together are ranked again and the best beam_width are
returned, text decoded from all their tokens (prompt included), as vLLM's offline API does.
"""

from __future__ import annotations

import math

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from minivllm.outputs import Logprob, RequestOutput
from minivllm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` include the prompt; `logprobs` holds, per generated token, the
    logprobs the step returned (its top tokens, the chosen one among them)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beam_width beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class BeamSearchInstance:
    """One prompt's search: its live beams and the complete ones (ended in eos)."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """cumulative_logprob / length ** length_penalty, the length counting the prompt and not a
    final eos (vLLM's rule)."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    # In log space, clamped: length ** length_penalty overflows (or reaches 0) for extreme
    # penalties such as 1e308, which must rank beams, not fail the request.
    scale = -length_penalty * math.log(max(length, 1))
    return cumulative_logprob * math.exp(min(max(scale, -700.0), 700.0))


def create_sort_beams_key_function(eos_token_id: int | None,
                                   length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    return lambda beam: get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id,
                                              length_penalty)


# One engine round: prompts (token ids), one SamplingParams, a LoRA request per prompt.
GenerateFn = Callable[[list[list[int]], SamplingParams, list[Any]], list[RequestOutput]]


class BeamSearch:
    """The search's state for a batch of prompts, driven by a loop that runs each step's
    requests on an engine (`run_beam_search` here, `engine/beam_search_stream.py` in the
    server): `next_beams()` -> one request per beam with `step_params` -> `advance(outputs)`."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams,
                 eos_token_id: int | None, lora_requests: Sequence[Any]) -> None:
        self.params, self.eos_token_id, self.steps = params, eos_token_id, 0
        self.step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                                          temperature=params.temperature,
                                          ignore_eos=params.ignore_eos, detokenize=False)
        self.key = create_sort_beams_key_function(eos_token_id, params.length_penalty)
        self.instances = [BeamSearchInstance([BeamSearchSequence(list(p), lora_request=lora)])
                          for p, lora in zip(prompts, lora_requests)]
        self._live: list[tuple[BeamSearchInstance, BeamSearchSequence]] = []

    def next_beams(self) -> list[BeamSearchSequence]:
        """The beams to extend by one token now; none once the search is over."""
        done = self.steps >= self.params.max_tokens
        self._live = [] if done else [(i, b) for i in self.instances for b in i.beams]
        return [beam for _, beam in self._live]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Takes the step's outputs (one per `next_beams()` beam, in order)."""
        grown: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in self.instances}
        for (inst, beam), output in zip(self._live, outputs, strict=True):
            top = output.outputs[0].logprobs[0]   # {token id: Logprob} of this beam's step
            for token, logprob in top.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                           beam.lora_request, beam.cum_logprob + logprob.logprob)
                if token == self.eos_token_id and not self.params.ignore_eos:
                    child.finish_reason = "stop"
                    inst.completed.append(child)
                else:
                    grown[id(inst)].append(child)
        width = self.params.beam_width
        for inst in self.instances:
            inst.beams = sorted(grown[id(inst)], key=self.key, reverse=True)[:width]
        self.steps += 1

    def results(self, decode: Callable[[list[int]], str] | None = None
                ) -> list[BeamSearchOutput]:
        """Per prompt the best beam_width of its complete and live beams (`text` decoded from
        all their tokens when `decode` is given)."""
        outputs = []
        for inst in self.instances:
            best = sorted(inst.completed + inst.beams, key=self.key,
                          reverse=True)[:self.params.beam_width]
            for beam in best:
                beam.text = decode(beam.tokens) if decode is not None else None
                beam.finish_reason = beam.finish_reason or "length"
            outputs.append(BeamSearchOutput(best))
        return outputs


def run_beam_search(generate: GenerateFn, prompts: Sequence[list[int]],
                    params: BeamSearchParams, eos_token_id: int | None,
                    decode: Callable[[list[int]], str],
                    lora_requests: Sequence[Any]) -> list[BeamSearchOutput]:
    """The search above for every prompt (token ids) at once: one engine round per step."""
    search = BeamSearch(prompts, params, eos_token_id, lora_requests)
    while beams := search.next_beams():
        search.advance(generate([b.tokens for b in beams], search.step_params,
                                [b.lora_request for b in beams]))
    return search.results(decode)
