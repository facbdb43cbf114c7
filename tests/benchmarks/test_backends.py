"""Backend helpers shared by the benchmarks."""

from minivllm.benchmarks.backends import left_pad


def test_left_pad():
    input_ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
