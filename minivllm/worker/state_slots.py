"""State slots of a hybrid model's running sequences: one row of every recurrent-state layer's
state tensor per sequence, taken when the sequence is first scheduled and given back when it
finishes or is preempted (preemption recomputes from the start, so its state restarts at 0)."""

import torch

from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata


class StateSlots:
    """req_id -> slot in [0, num_slots); `num_slots` is the scheduler's max_num_seqs."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))      # pop() hands out 0 first
        self._slot_of: dict[str, int] = {}

    def release(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            slot = self._slot_of.pop(req_id, None)
            if slot is not None:
                self._free.append(slot)

    def slot(self, req_id: str) -> int:
        slot = self._slot_of.get(req_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"all {self.num_slots} state slots are taken: the scheduler "
                                   "ran more sequences than max_num_seqs")
            slot = self._slot_of[req_id] = self._free.pop()
        return slot

    def metadata(self, req_ids: list[str], num_computed: list[int],
                 query_start_loc: torch.Tensor) -> ShortConvAttentionMetadata:
        """The step's metadata; a sequence with no computed token starts from a zero state."""
        slots = torch.tensor([self.slot(r) for r in req_ids], dtype=torch.int64)
        qsl = query_start_loc.to(torch.int64)
        return ShortConvAttentionMetadata(
            query_start_loc=qsl, state_indices=slots,
            has_initial_state=torch.tensor(num_computed, dtype=torch.int64) > 0,
            num_actual_tokens=int(qsl[-1]),
            seq_lens=torch.tensor(num_computed, dtype=torch.int64) + qsl[1:] - qsl[:-1])
