"""The batched LoRA product equals a per-token reference, for one slot and for many."""

import torch

from minivllm.lora.punica_wrapper import PunicaWrapper


def _reference(out, x, a, b, slices, slots, rank):
    out = out.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for k, (offset, size) in enumerate(slices):
            shrink = a[slot, k * rank:(k + 1) * rank] @ x[t]            # [R]
            out[t, offset:offset + size] += shrink @ b[k][slot]
    return out


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
    punica.add_lora_linear(out, x, a, b, slices)
    return out, want, punica


def test_many_slots_and_base_tokens():
    out, want, punica = _case([0, 2, -1, 1, 2, 0, -1])
    assert punica.slot_mask is not None
    torch.testing.assert_close(out, want)


def test_one_slot_with_and_without_base_tokens():
    for slots in ([1, 1, 1], [1, -1, 1]):
        out, want, punica = _case(slots)
        assert punica.active_slots == [1] and punica.slot_mask is None
        torch.testing.assert_close(out, want)


def test_base_only_changes_nothing():
    out, want, punica = _case([-1, -1])
    assert punica.active_slots == []
    torch.testing.assert_close(out, want)
