"""The batched LoRA product equals a per-token reference, for one slot and for many."""

import torch

from minivllm.lora.punica_wrapper import PunicaWrapper


def _reference(out, x, a, b, slices, slots, rank):
    """Per token and per packed slice: out[t, slice k] += B_k A_k x[t]."""
    out = out.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for k, (offset, size) in enumerate(slices):
            shrink = a[slot, k * rank:(k + 1) * rank] @ x[t]            # [R]
            out[t, offset:offset + size] += shrink @ b[k][slot]
    return out


def _block_diagonal(b, slices, rank):
    """The layers' B table: slice k's B^T at rows [k*R, (k+1)*R) and its output columns."""
    table = torch.zeros(b[0].shape[0], len(b) * rank, sum(s for _, s in slices),
                        dtype=b[0].dtype)
    for k, (offset, size) in enumerate(slices):
        table[:, k * rank:(k + 1) * rank, offset:offset + size] = b[k]
    return table


def _case(slots: list[int]):
    gen = torch.Generator().manual_seed(0)
    loras, rank, d_in, sizes = 3, 4, 10, [6, 2, 2]
    slices = [(sum(sizes[:k]), s) for k, s in enumerate(sizes)]
    x = torch.randn(len(slots), d_in, generator=gen, dtype=torch.float64)
    a = torch.randn(loras, len(sizes) * rank, d_in, generator=gen, dtype=torch.float64)
    b = [torch.randn(loras, rank, s, generator=gen, dtype=torch.float64) for s in sizes]
    out = torch.randn(len(slots), sum(sizes), generator=gen, dtype=torch.float64)
    punica = PunicaWrapper(loras, torch.float64)
    punica.update(torch.tensor(slots))
    want = _reference(out, x, a, b, slices, torch.tensor(slots), rank)
    punica.add_lora_linear(out, x, a, _block_diagonal(b, slices, rank))
    return out, want, punica


def test_many_slots_and_base_tokens():
    out, want, punica = _case([0, 2, -1, 1, 2, 0, -1])
    assert punica.gather_index is not None and punica.gather_mask is not None   # padded groups
    torch.testing.assert_close(out, want)


def test_one_slot_with_and_without_base_tokens():
    for slots in ([1, 1, 1], [1, -1, 1]):
        out, want, punica = _case(slots)
        assert punica.active_slots == [1] and punica.gather_index is None
        torch.testing.assert_close(out, want)


def test_base_only_changes_nothing():
    out, want, punica = _case([-1, -1])
    assert punica.active_slots == []
    torch.testing.assert_close(out, want)


def test_some_slots_equal_groups():
    """Slots 0 and 2 of 3, two tokens each: no padding, the tables' active slots picked."""
    out, want, punica = _case([2, 0, 2, -1, 0])
    assert punica.gather_mask is None and punica.slot_index.tolist() == [0, 2]
    torch.testing.assert_close(out, want)


def test_sorted_slots_take_row_ranges():
    """Tokens sorted by slot (the runner's order): one contiguous run per slot, no gather."""
    out, want, punica = _case([-1, 0, 0, 2, 2, 2, 1])
    assert punica.runs == [(0, 1, 3), (2, 3, 6), (1, 6, 7)]
    torch.testing.assert_close(out, want)
