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
    return cumulative_logprob / (max(length, 1) ** length_penalty)


def create_sort_beams_key_function(eos_token_id: int | None,
                                   length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    return lambda beam: get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id,
                                              length_penalty)


# One engine round: prompts (token ids), one SamplingParams, a LoRA request per prompt.
GenerateFn = Callable[[list[list[int]], SamplingParams, list[Any]], list[RequestOutput]]


def run_beam_search(generate: GenerateFn, prompts: Sequence[list[int]],
                    params: BeamSearchParams, eos_token_id: int | None,
                    decode: Callable[[list[int]], str],
                    lora_requests: Sequence[Any]) -> list[BeamSearchOutput]:
    """The search above for every prompt (token ids) at once: one engine round per step."""
    width = params.beam_width
    step_params = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature,
                                 ignore_eos=params.ignore_eos, detokenize=False)
    key = create_sort_beams_key_function(eos_token_id, params.length_penalty)
    instances = [BeamSearchInstance([BeamSearchSequence(list(p), lora_request=lora)])
                 for p, lora in zip(prompts, lora_requests)]
    for _ in range(params.max_tokens):
        live = [(inst, beam) for inst in instances for beam in inst.beams]
        if not live:
            break
        outputs = generate([beam.tokens for _, beam in live], step_params,
                           [beam.lora_request for _, beam in live])
        grown: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
        for (inst, beam), output in zip(live, outputs):
            top = output.outputs[0].logprobs[0]   # {token id: Logprob} of this beam's step
            for token, logprob in top.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                           beam.lora_request, beam.cum_logprob + logprob.logprob)
                if token == eos_token_id and not params.ignore_eos:
                    child.finish_reason = "stop"
                    inst.completed.append(child)
                else:
                    grown[id(inst)].append(child)
        for inst in instances:
            inst.beams = sorted(grown[id(inst)], key=key, reverse=True)[:width]
    results = []
    for inst in instances:
        best = sorted(inst.completed + inst.beams, key=key, reverse=True)[:width]
        for beam in best:
            beam.text = decode(beam.tokens)
            beam.finish_reason = beam.finish_reason or "length"
        results.append(BeamSearchOutput(best))
    return results
