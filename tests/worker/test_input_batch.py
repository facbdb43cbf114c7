"""prepare_inputs: the one-token-per-request path builds exactly what the general path builds."""

import dataclasses

import torch

from minivllm.sampling_params import SamplingParams
from minivllm.worker import input_batch
from minivllm.worker.input_batch import CachedRequestState, prepare_inputs


class _StepOutput:
    """The three SchedulerOutput fields prepare_inputs reads."""

    def __init__(self, num_scheduled_tokens: dict[str, int],
                 spec: dict[str, list[int]] | None = None) -> None:
        self.num_scheduled_tokens = num_scheduled_tokens
        self.total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        self.scheduled_spec_decode_tokens = spec or {}


def _states() -> dict[str, CachedRequestState]:
    params = SamplingParams()
    # a: decoding at position 9 (block 2 of size 4); b: a prompt chunk of one token that does
    # not reach its end (no sampling row); c: decoding at position 0 of a 1-token prompt.
    return {"a": CachedRequestState("a", list(range(100, 110)), 6, [7, 3, 5], 9, params),
            "b": CachedRequestState("b", list(range(200, 220)), 20, [1, 2], 4, params),
            "c": CachedRequestState("c", [300], 1, [9], 0, params)}


def test_one_token_path_equals_the_general_path():
    states = _states()
    so = _StepOutput({"a": 1, "b": 1, "c": 1})
    fast = prepare_inputs(states, so, block_size=4)
    general = input_batch._prepare_chunks(states, so, list(so.num_scheduled_tokens), 4)
    for field in dataclasses.fields(fast):
        a, b = getattr(fast, field.name), getattr(general, field.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), field.name
        else:
            assert a == b, field.name
    assert fast.slot_mapping.tolist() == [5 * 4 + 1, 2 * 4 + 0, 9 * 4 + 0]
    assert fast.sample_rows == [0, 2]


def test_draft_tokens_follow_the_last_known_token_and_each_gets_a_logits_row():
    # a decodes with 3 drafts (4 tokens at positions 9..12), b runs a prompt chunk, c decodes
    # with 1 draft: rows of a = its last known token and its drafts, likewise for c.
    states = _states()
    states["a"].block_ids.append(6)   # position 12 starts block 3: the scheduler allocated it
    so = _StepOutput({"a": 4, "b": 2, "c": 2}, spec={"a": [7, 8, 9], "c": [42]})
    inputs = prepare_inputs(states, so, block_size=4)
    assert inputs.input_ids.tolist() == [109, 7, 8, 9, 204, 205, 300, 42]
    assert inputs.positions.tolist() == [9, 10, 11, 12, 4, 5, 0, 1]
    assert inputs.sample_rows == [0, 2] and inputs.num_draft_tokens == [3, 1]
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 6, 7]
    assert inputs.slot_mapping[:4].tolist() == [5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 0]
