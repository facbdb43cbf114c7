"""State slots: one per running sequence, reused once released; the step metadata marks which
sequences start from a zero state."""

import pytest
import torch

from minivllm.worker.state_slots import StateSlots


def test_slots_are_reused_and_bounded():
    slots = StateSlots(2)
    assert slots.slot("a") == 0 and slots.slot("b") == 1 and slots.slot("a") == 0
    with pytest.raises(RuntimeError, match="all 2 state slots"):
        slots.slot("c")
    slots.release({"a", "unknown"})
    assert slots.slot("c") == 0


def test_metadata_marks_fresh_sequences():
    slots = StateSlots(4)
    md = slots.metadata(["x", "y", "z"], [0, 5, 3], torch.tensor([0, 4, 5, 7], dtype=torch.int32))
    assert md.state_indices.tolist() == [0, 1, 2]
    assert md.has_initial_state.tolist() == [False, True, True]
    assert md.token_rows.tolist() == [0, 0, 0, 0, 1, 2, 2] and md.num_actual_tokens == 7
