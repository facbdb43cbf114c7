"""The native row gather behind embedding lookups (csrc/gather_rows.cpp)."""

import pytest
import torch

from minivllm.model_executor.kernels.embedding import gather_rows

pytestmark = pytest.mark.requires_native


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_equals_index_select(dtype):
    table = (torch.randn(50, 40) * 50).to(dtype)
    ids = torch.tensor([[3, 49, 0], [3, 7, 11]])
    out = gather_rows(table, ids)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out, table[ids])
    strided = torch.randn(50, 64)[:, 8:48]                     # rows 64 apart, 40 wide
    assert torch.equal(gather_rows(strided, ids[0]), strided[ids[0]])


def test_out_of_range_id_names_the_range():
    table = torch.randn(10, 4)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        gather_rows(table, torch.tensor([2, 10]))
    with pytest.raises(IndexError):
        gather_rows(table, torch.tensor([-1]))
