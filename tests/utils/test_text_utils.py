"""held_back: the tail of a text that may still become a marker."""

from minivllm.utils.text_utils import held_back


def test_held_back_counts_the_longest_marker_start_at_the_end():
    assert held_back("answer </thi", "</think>") == 5
    assert held_back("answer <", "</think>") == 1
    assert held_back("answer", "</think>") == 0
    assert held_back("a </think>", "</think>") == 0      # complete: not held, the caller splits
    assert held_back("", "</think>") == 0
    assert held_back("x STO", "STOP") == 3 and held_back("x STOPX", "STOP") == 0
