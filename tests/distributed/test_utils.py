"""distributed/utils.py: split_tensor_along_last_dim."""

import pytest
import torch

from minivllm.distributed.utils import split_tensor_along_last_dim


def test_split_tensor_along_last_dim():
    x = torch.arange(24.0).view(2, 12)
    parts = split_tensor_along_last_dim(x, 3)
    assert [p.shape for p in parts] == [(2, 4)] * 3
    torch.testing.assert_close(torch.cat(parts, dim=-1), x)
    assert parts[1].data_ptr() == x[:, 4:].data_ptr() and not parts[1].is_contiguous()
    copies = split_tensor_along_last_dim(x, 3, contiguous_split_chunks=True)
    assert all(c.is_contiguous() for c in copies) and torch.equal(copies[2], x[:, 8:])
    with pytest.raises(AssertionError, match="12 is not divisible by 5"):
        split_tensor_along_last_dim(x, 5)
