"""`direct_register_custom_op` puts an op where a vLLM model file calls it, `torch.ops.vllm`,
as well as under minivllm's namespace; a mutated argument is written in place."""

import torch

from minivllm.utils.torch_utils import direct_register_custom_op


def _fill_doubled(x: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    out.copy_(2 * x + len(layer_name))


def test_registered_op_is_callable_as_torch_ops_vllm():
    direct_register_custom_op("test_fill_doubled", _fill_doubled, mutates_args=["out"])
    x = torch.arange(4.0)
    for op in (torch.ops.vllm.test_fill_doubled, torch.ops.minivllm.test_fill_doubled):
        out = torch.zeros(4)
        op(x, out, "ab")
        assert torch.equal(out, 2 * x + 2)
