"""triton_utils: files that define Triton kernels import on CPU, and launching one fails clearly."""

import math

import pytest

from minivllm import triton_utils
from minivllm.triton_utils import LOG2E, _placeholders


def test_log2e_and_flag() -> None:
    assert LOG2E == pytest.approx(1 / math.log(2))
    assert isinstance(triton_utils.HAS_TRITON, bool)


def test_placeholder_kernels_define_and_refuse_to_launch() -> None:
    triton, tl = _placeholders()

    @triton.jit
    def add_kernel(x_ptr, n: tl.constexpr, BLOCK: tl.constexpr = 64):
        tl.store(x_ptr, tl.load(x_ptr) + 1)

    @triton.autotune(configs=[triton.Config({"BLOCK": 32}, num_warps=4)], key=["n"])
    @triton.jit(do_not_specialize=["n"])
    def tuned_kernel(x_ptr, n):
        pass

    assert add_kernel.__name__ == "add_kernel"
    with pytest.raises(RuntimeError, match="add_kernel.*Triton is not installed"):
        add_kernel[(triton.cdiv(10, 4),)](None, 10)
    with pytest.raises(RuntimeError, match="tuned_kernel"):
        tuned_kernel(None, 3)
    # A kernel body reaching device code also says what happened.
    with pytest.raises(RuntimeError, match="triton.language.load"):
        tl.load(None)


def test_placeholder_host_helpers_compute() -> None:
    triton, tl = _placeholders()
    assert [triton.cdiv(a, 4) for a in (0, 1, 4, 5, 9)] == [0, 1, 1, 2, 3]
    assert [triton.next_power_of_2(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert "float32" in repr(tl.float32)
    assert "math.exp" in repr(tl.math.exp)
    with pytest.raises(AttributeError):
        tl.__wrapped__
