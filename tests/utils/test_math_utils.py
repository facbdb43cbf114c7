"""utils.math_utils."""

from minivllm.utils.math_utils import cdiv, next_power_of_2, round_down, round_up


def test_integer_helpers():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert (round_up(5, 4), round_up(8, 4), round_down(7, 4)) == (8, 8, 4)
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
