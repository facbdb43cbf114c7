"""vLLM's batch-level logits processor interface: the persistent-batch layout the processors
see (BatchUpdate removed / added / moved), the row permutation around them, process_dict_updates,
and loading classes by name and by entry point."""

import random
import sys

import pytest
import torch

import minivllm.plugins as plugins
from minivllm.sampling_params import SamplingParams
from minivllm.v1.sample.logits_processor import (LOGITSPROCS_GROUP, BatchUpdate, LogitsProcessor,
                                                 LogitsProcessorBatch, LogitsProcessors,
                                                 MoveDirectionality, load_custom_logitsprocs,
                                                 process_dict_updates)
from tests.test_plugins import _fake_distribution
from tests.v1.sample._logitsprocs import NotAProcessor, TargetTokenProcessor


class TagProcessor(LogitsProcessor):
    """Keeps each batch index's request tag (extra_args["tag"]) from the updates alone, and
    writes it into its rows: the test reads back which request each row was taken for."""

    def __init__(self, vllm_config=None, device=None, is_pin_memory=False) -> None:
        self.tags: dict[int, int] = {}
        self.sizes: list[int] = []

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            assert sorted(batch_update.removed) == list(batch_update.removed)
            self.sizes.append(batch_update.batch_size)
        process_dict_updates(self.tags, batch_update, lambda p, _, __: p.extra_args["tag"])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert sorted(self.tags) == list(range(logits.shape[0]))   # indices 0..B-1, all known
        logits[:, 0] = torch.tensor([float(self.tags[i]) for i in range(logits.shape[0])])
        return logits


def test_layout_follows_joins_leaves_and_reorders():
    """Across random steps (requests join, finish, sit a step out, come back, rows shuffled),
    every processor row holds the request of the matching logits row."""
    rng = random.Random(0)
    proc = TagProcessor()
    batch = LogitsProcessorBatch(LogitsProcessors([proc]))
    live: list[str] = []
    next_id = 0
    for _ in range(300):
        for _ in range(rng.randint(0, 3)):   # arrivals
            batch.add_request(f"r{next_id}", SamplingParams(extra_args={"tag": next_id}),
                              [1, 2], [])
            live.append(f"r{next_id}")
            next_id += 1
        for req_id in rng.sample(live, k=min(len(live), rng.randint(0, 2))):   # finished
            live.remove(req_id)
            batch.remove_request(req_id)
        rows = [r for r in live if rng.random() < 0.8]   # the others sit this step out
        rng.shuffle(rows)
        if not rows:
            continue
        step = batch.step(rows)
        out = step.apply(torch.zeros(len(rows), 4), argmax_invariant=False)
        assert out[:, 0].tolist() == [float(r[1:]) for r in rows]
        assert step.apply(out, argmax_invariant=True) is out   # no invariant processors
    assert max(proc.sizes) >= 8 and next_id > 200


def test_unchanged_batch_sends_none_and_keeps_the_order():
    seen = []

    class Spy(TagProcessor):
        def update_state(self, batch_update):
            seen.append(batch_update)
            super().update_state(batch_update)
    batch = LogitsProcessorBatch(LogitsProcessors([Spy()]))
    for i in range(3):
        batch.add_request(f"r{i}", SamplingParams(extra_args={"tag": i}), [5], [])
    first = batch.step(["r0", "r1", "r2"])
    again = batch.step(["r0", "r1", "r2"])
    assert seen[1] is None and first.order is None and again.order is None
    added = seen[0].added
    assert [(i, o) for i, _, _, o in added] == [(0, []), (1, []), (2, [])]
    batch.append_tokens(["r0"], [42])
    assert added[0][3] == [42]   # the live output list a processor keeps
    batch.remove_request("r0")
    third = batch.step(["r1", "r2"])
    assert seen[2].removed == [0] and seen[2].added == []
    assert seen[2].moved == [(2, 0, MoveDirectionality.UNIDIRECTIONAL)]
    assert third.order.tolist() == [1, 0]   # index 0 is now r2 (row 1), index 1 r1 (row 0)


def test_process_dict_updates_swaps_and_clears():
    entries = {0: "a", 1: "b", 2: "c"}
    params = SamplingParams()
    update = BatchUpdate(3, removed=[1], added=[(1, params, [], [])],
                         moved=[(0, 2, MoveDirectionality.SWAP)])
    assert process_dict_updates(entries, update, lambda *_: "new")
    assert entries == {0: "c", 1: "new", 2: "a"}
    update = BatchUpdate(2, removed=[], added=[(0, params, [], [])],
                         moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)])
    assert process_dict_updates(entries, update, lambda *_: None)
    assert entries == {1: "a"}
    assert not process_dict_updates(entries, None, lambda *_: "x")


def test_loading_by_class_and_by_name():
    names = ["tests.v1.sample._logitsprocs:TargetTokenProcessor",
             "tests.v1.sample._logitsprocs.TargetTokenProcessor", TargetTokenProcessor]
    assert load_custom_logitsprocs(names) == [TargetTokenProcessor] * 3
    assert load_custom_logitsprocs(None) == []
    for bad, message in (("tests.v1.sample._logitsprocs:Missing", "Cannot load"),
                         ("no_such_module_xyz:Proc", "Cannot load"),
                         ("tests.v1.sample._logitsprocs:NotAProcessor", "is not a subclass"),
                         (NotAProcessor, "is not a subclass"), (5, "give a LogitsProcessor")):
        with pytest.raises(ValueError, match=message):
            load_custom_logitsprocs([bad])
    with pytest.raises(ValueError, match="must be a list"):
        load_custom_logitsprocs("tests.v1.sample._logitsprocs:TargetTokenProcessor")


def test_entry_point_plugins_are_loaded(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "fake_logitsprocs_plugin", """
        from tests.v1.sample._logitsprocs import TargetTokenProcessor as Target
    """, ())
    info = tmp_path / "fake_logitsprocs_plugin-0.1.dist-info" / "entry_points.txt"
    info.write_text(f"[{LOGITSPROCS_GROUP}]\ntarget = fake_logitsprocs_plugin:Target\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    try:
        assert load_custom_logitsprocs([]) == [TargetTokenProcessor]
        assert list(plugins.load_plugins_by_group(LOGITSPROCS_GROUP)) == ["target"]
    finally:
        sys.modules.pop("fake_logitsprocs_plugin", None)
