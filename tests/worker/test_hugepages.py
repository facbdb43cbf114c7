"""Huge-page arenas for the KV cache and weights: layout, zeroing, madvise, parameter re-homing."""

import sys

import pytest
import torch

from minivllm.worker import hugepages


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping that holds `addr` (Linux /proc/self/smaps)."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= addr < hi
            elif current and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError("address not mapped")


def test_zeros_are_separate_zeroed_aligned_tensors():
    shapes = [(torch.Size([2, 5, 16, 3, 64]), torch.bfloat16), (torch.Size([7]), torch.float32),
              (torch.Size([3, 3]), torch.int64)]
    tensors = hugepages.zeros(shapes)
    spans = []
    for t, (shape, dtype) in zip(tensors, shapes):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 64 == 0 and bool((t == 0).all())
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        t.fill_(1)   # writable, and the next check shows no tensor overlaps another
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert all(bool((t == 1).all()) for t in tensors)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")
def test_arena_is_advised_for_huge_pages(monkeypatch):
    buf = hugepages.arena(3 * hugepages.HUGE_PAGE)
    assert buf.data_ptr() % hugepages.HUGE_PAGE == 0 and bool((buf == 0).all())
    assert "hg" in _vm_flags(buf.data_ptr())           # MADV_HUGEPAGE recorded on the range
    # Switched off, no range is advised. (Asked of the call, not of smaps: with the switch off
    # malloc may hand out heap memory that an earlier, freed arena had advised.)
    calls = []
    monkeypatch.setattr(hugepages, "_madvise", lambda *args: calls.append(args) or 0)
    hugepages.arena(3 * hugepages.HUGE_PAGE)
    assert len(calls) == 1                              # the fake is what arena() calls
    monkeypatch.setenv("MINIVLLM_HUGEPAGES", "0")
    plain = hugepages.arena(3 * hugepages.HUGE_PAGE)
    assert len(calls) == 1 and bool((plain == 0).all())


def _rss_kb(addr: int) -> int:
    """Resident kB of the mapping that holds `addr` (Linux /proc/self/smaps)."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= addr < hi
            elif current and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("address not mapped")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux's")
def test_arena_is_resident_only_where_touched(monkeypatch):
    # The KV budget (2 GiB by default) must cost neither start-up time nor memory until used.
    # (Advised, the arena is a mapping of its own: smaps then counts it alone.)
    monkeypatch.setenv("MINIVLLM_HUGEPAGES", "1")
    buf = hugepages.arena(256 << 20)
    before = _rss_kb(buf.data_ptr())
    assert before < (256 << 10) // 8                  # not resident (zeroing made all of it so)
    buf[:10].fill_(1)
    buf[-10:].fill_(2)
    assert 0 < _rss_kb(buf.data_ptr()) - before <= 2 * hugepages.HUGE_PAGE // 1024   # 2 pages
    assert bool((buf[10:-10] == 0).all()) and int(buf[:10].sum()) == 10


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64)
        self.head = torch.nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight            # tied: one Parameter in two modules
        self.norm = torch.nn.Parameter(torch.randn(64))  # small: stays where it is
        self.big = torch.nn.Parameter(torch.randn(1024, 1024))  # 4 MB: a huge page or more
        self.base = torch.nn.Parameter(torch.randn(256, 256))
        self.view = torch.nn.Parameter(self.base.data[:128])   # shares base's storage


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_rehome_parameters_moves_large_owned_ones_only():
    model = _Tied()
    before = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)}
    marker = object()
    model.big.marker = marker
    moved = hugepages.rehome_parameters(model)
    assert moved == (300 * 64 + 1024 * 1024) * 4
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p, before[name]), name
    assert model.embed.weight.data_ptr() != ptrs["embed.weight"]
    assert model.big.data_ptr() != ptrs["big"] and model.big.marker is marker
    assert model.head.weight is model.embed.weight        # still tied
    for name in ("norm", "base", "view"):                  # small, or sharing storage
        assert getattr(model, name).data_ptr() == ptrs[name]
    assert "hg" in _vm_flags(model.big.data_ptr())
    out = model.head(model.embed(torch.tensor([3, 7])))   # the model still runs
    assert out.shape == (2, 300)
