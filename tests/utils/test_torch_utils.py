"""utils.torch_utils: dtype helpers, version checks, seeding, custom-op registration."""

import pytest
import torch

from minivllm.utils.torch_utils import (STR_DTYPE_TO_TORCH_DTYPE, direct_register_custom_op,
                                        get_dtype_size, is_torch_equal_or_newer,
                                        set_default_torch_dtype, set_random_seed)


def test_dtype_helpers_and_versions():
    assert [get_dtype_size(d) for d in (torch.float32, torch.bfloat16, torch.int8)] == [4, 2, 1]
    assert STR_DTYPE_TO_TORCH_DTYPE["half"] is torch.float16
    assert is_torch_equal_or_newer("2.0") and not is_torch_equal_or_newer("99.0")
    with pytest.raises(RuntimeError), set_default_torch_dtype(torch.float16):
        assert torch.get_default_dtype() is torch.float16
        raise RuntimeError
    assert torch.get_default_dtype() is torch.float32


def test_set_random_seed_repeats():
    set_random_seed(3)
    first = torch.rand(4)
    set_random_seed(3)
    assert torch.equal(first, torch.rand(4))


def _scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return x + alpha * y


def test_direct_register_custom_op_runs_eager_and_compiled():
    direct_register_custom_op("test_scaled_add", _scaled_add,
                              fake_impl=lambda x, y, alpha: torch.empty_like(x))
    x, y = torch.randn(5), torch.randn(5)
    op = torch.ops.minivllm.test_scaled_add
    torch.testing.assert_close(op(x, y, 0.5), x + 0.5 * y)
    # the fake impl gives shapes to a traced graph
    traced = torch.compile(lambda a, b: op(a, b, 2.0) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(traced(x, y), (x + 2.0 * y) * 2)
