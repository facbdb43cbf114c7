"""vLLM's v2 parameter classes load their own shard: narrowing by TP rank, shard offsets, packed
dims, per-tensor slots; the v2 registry."""

import pytest
import torch

from minivllm.model_executor.parameter import (WEIGHT_LOADER_V2_SUPPORTED, BasevLLMParameter,
                                              ChannelQuantScaleParameter,
                                              GroupQuantScaleParameter, ModelWeightParameter,
                                              PackedColumnParameter, PackedvLLMParameter,
                                              PerTensorScaleParameter, RowvLLMParameter,
                                              register_weight_loader_v2_supported_method)


def _loader(*args):
    raise AssertionError("not called here")


def _param(cls, shape, rank=0, size=1, dtype=torch.float32, **kwargs):
    p = cls(data=torch.zeros(shape, dtype=dtype), weight_loader=_loader, **kwargs)
    p.tp_rank, p.tp_size = rank, size
    return p


def test_base_parameter_basics():
    p = _param(BasevLLMParameter, (1,))
    assert isinstance(p, torch.nn.Parameter) and not p.requires_grad
    assert p.weight_loader is _loader and (p.tp_rank, p.tp_size) == (0, 1)
    p.load_column_parallel_weight(torch.tensor(3.0))          # a scalar on disk fills [1]
    assert p.item() == 3.0
    with pytest.raises(AssertionError, match="cannot load"):
        p.load_row_parallel_weight(torch.zeros(2))


def test_model_weight_column_row_merged_qkv():
    w = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    col = _param(ModelWeightParameter, (4, 4), rank=1, size=2, input_dim=1, output_dim=0)
    col.load_column_parallel_weight(w)
    assert torch.equal(col.data, w[4:])
    row = _param(ModelWeightParameter, (8, 2), rank=1, size=2, input_dim=1, output_dim=0)
    row.load_row_parallel_weight(w)
    assert torch.equal(row.data, w[:, 2:])
    merged = _param(ModelWeightParameter, (8, 4), rank=1, size=2, input_dim=1, output_dim=0)
    merged.load_merged_column_weight(w, shard_id=1, shard_offset=4, shard_size=4)
    assert torch.equal(merged.data[4:], w[4:]) and merged.data[:4].abs().sum() == 0
    # KV replicated twice: rank 1 reads KV block 1 // 2 = 0
    qkv = _param(ModelWeightParameter, (6, 4), rank=1, size=2, input_dim=1, output_dim=0)
    qkv.load_qkv_weight(w[:4], shard_id="k", shard_offset=2, shard_size=2, num_heads=2)
    assert torch.equal(qkv.data[2:4], w[:2])
    qkv.load_qkv_weight(w[:4], shard_id="q", shard_offset=0, shard_size=2, num_heads=2)
    assert torch.equal(qkv.data[0:2], w[2:4])


def test_per_tensor_scale_slots():
    p = _param(PerTensorScaleParameter, (3,))
    for i, shard in enumerate("qkv"):
        p.load_qkv_weight(torch.tensor(float(i + 1)), shard_id=shard)
    assert p.tolist() == [1.0, 2.0, 3.0]
    p.load_qkv_weight(torch.tensor([7.0]), shard_id=None)      # fused on disk: every slot
    assert p.tolist() == [7.0, 7.0, 7.0]
    merged = _param(PerTensorScaleParameter, (2,))
    merged.load_merged_column_weight(torch.tensor(5.0), shard_id=1, shard_offset=0, shard_size=1)
    assert merged.tolist() == [0.0, 5.0]
    with pytest.raises(ValueError, match="'q', 'k', 'v'"):
        p.load_qkv_weight(torch.tensor(1.0), shard_id="x")


def test_scales_shard_like_their_weight():
    ch = _param(ChannelQuantScaleParameter, (2, 1), rank=1, size=2, output_dim=0)
    ch.load_column_parallel_weight(torch.arange(4.0).reshape(4, 1))
    assert ch.flatten().tolist() == [2.0, 3.0]
    # group scales [out, in / group]: column- and row-sharded
    g = _param(GroupQuantScaleParameter, (4, 1), rank=1, size=2, input_dim=1, output_dim=0)
    g.load_row_parallel_weight(torch.arange(8.0).reshape(4, 2))
    assert g.flatten().tolist() == [1.0, 3.0, 5.0, 7.0]
    row = _param(RowvLLMParameter, (2,), rank=1, size=2, input_dim=0)
    row.load_row_parallel_weight(torch.arange(4.0))
    assert row.tolist() == [2.0, 3.0]


def test_packed_parameters_divide_offsets():
    # int4 x8 in int32 along the output dim: 16 logical rows are 2 stored rows
    p = _param(PackedvLLMParameter, (4, 3), rank=1, size=2, dtype=torch.int32, packed_factor=8,
               packed_dim=0, input_dim=1, output_dim=0)
    ckpt = torch.arange(4 * 3, dtype=torch.int32).reshape(4, 3)     # one matrix of 32 rows
    p.load_merged_column_weight(ckpt, shard_id=1, shard_offset=16, shard_size=16)
    assert torch.equal(p.data[2:], ckpt[2:]) and p.data[:2].abs().sum() == 0
    assert p.adjust_shard_indexes_for_packing(shard_size=16, shard_offset=32) == (2, 4)
    # packed along the input dim (GPTQ qweight [in / 8, out]): the column dim is unaffected
    zeros = _param(PackedColumnParameter, (2, 2), rank=0, size=2, dtype=torch.int32,
                   packed_factor=8, packed_dim=1, output_dim=0)
    zeros.load_column_parallel_weight(torch.arange(8, dtype=torch.int32).reshape(4, 2))
    assert zeros.flatten().tolist() == [0, 1, 2, 3]


def test_register_weight_loader_v2_supported_method():
    class SomeTestMethod:
        pass

    assert register_weight_loader_v2_supported_method(SomeTestMethod) is SomeTestMethod
    register_weight_loader_v2_supported_method(SomeTestMethod)
    assert WEIGHT_LOADER_V2_SUPPORTED.count("SomeTestMethod") == 1
    from minivllm.model_executor.layers.quantization import fp8, int8  # noqa: F401 (registers)

    assert {"Fp8LinearMethod", "Int8LinearMethod"} <= set(WEIGHT_LOADER_V2_SUPPORTED)
    assert "UnquantizedLinearMethod" not in WEIGHT_LOADER_V2_SUPPORTED    # kept on v1
