"""weight_loader_v2 on every linear layer type, at TP=1 and as rank 1 of TP=2 (the TP getters
patched; loading needs no collectives): v2 parameters land exactly where the v1 loader puts a
plain weight / bias, per shard id and fused on disk, with KV heads replicated."""

import pytest
import torch

from minivllm.model_executor.layers import linear as linear_module
from minivllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear, QKVParallelLinear,
                                                   ReplicatedLinear, RowParallelLinear)
from minivllm.model_executor.layers.quantization import (QuantizationConfig,
                                                         UnquantizedLinearMethod)
from minivllm.model_executor.parameter import (BlockQuantScaleParameter,
                                              ChannelQuantScaleParameter, ModelWeightParameter,
                                              PackedvLLMParameter, PerTensorScaleParameter,
                                              register_weight_loader_v2_supported_method)
from tests.model_executor.layers._helpers import layer_context

BLOCK = 16


@register_weight_loader_v2_supported_method
class V2TestMethod(UnquantizedLinearMethod):
    """A weight plus one parameter of each v2 kind, all fed by `weight_loader_v2`."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra):
        loader = extra["weight_loader"]
        rows, cols = sum(output_partition_sizes), input_size_per_partition
        row_layer = isinstance(layer, RowParallelLinear)
        layer.weight_block_size = [BLOCK, BLOCK]
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.zeros(rows, cols), input_dim=1, output_dim=0, weight_loader=loader))
        layer.register_parameter("weight_scale", PerTensorScaleParameter(
            data=torch.zeros(len(output_partition_sizes)), weight_loader=loader))
        layer.register_parameter("channel_scale", ChannelQuantScaleParameter(
            data=torch.zeros(rows), output_dim=0, weight_loader=loader))
        layer.register_parameter("block_scale", BlockQuantScaleParameter(
            data=torch.zeros(rows // BLOCK, cols // BLOCK), input_dim=1, output_dim=0,
            weight_loader=loader))
        packed_dim = 1 if row_layer else 0
        shape = (rows, cols // 2) if row_layer else (rows // 2, cols)
        layer.register_parameter("qweight", PackedvLLMParameter(
            data=torch.zeros(shape, dtype=torch.int32), packed_factor=2, packed_dim=packed_dim,
            input_dim=1, output_dim=0, weight_loader=loader))


class V2Config(QuantizationConfig):
    def get_name(self): return "v2-test"
    def get_supported_act_dtypes(self): return [torch.float32]
    @classmethod
    def get_min_capability(cls): return 0
    @staticmethod
    def get_config_filenames(): return []
    @classmethod
    def from_config(cls, config): return cls()
    def get_quant_method(self, layer, prefix): return V2TestMethod()


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _shards(layer, in_size):
    """Per logical matrix: (shard id, weight [rows, in], block scale, packed int32, scalar)."""
    if isinstance(layer, QKVParallelLinear):
        ids = ["q", "k", "v"]
        rows = [layer.total_num_heads * layer.head_size] + [layer.total_num_kv_heads * layer.head_size] * 2
    else:
        ids = list(range(len(layer.output_sizes)))
        rows = list(layer.output_sizes)
    out = []
    for i, (sid, n) in enumerate(zip(ids, rows)):
        out.append((sid, _rand(n, in_size, seed=i), _rand(n // BLOCK, in_size // BLOCK, seed=10 + i),
                    torch.randint(0, 99, (n // 2, in_size), dtype=torch.int32,
                                  generator=torch.Generator().manual_seed(20 + i)),
                    torch.tensor(float(i + 1))))
    return out


def _load_fused(v1, v2, shards, fused_on_disk):
    groups = [(None, shards)] if fused_on_disk else [(s[0], [s]) for s in shards]
    for sid, group in groups:
        cat = [torch.cat([g[j] for g in group]) for j in (1, 2, 3)]
        v1.weight.weight_loader(v1.weight, cat[0], sid)
        v1.bias.weight_loader(v1.bias, cat[0][:, 0].contiguous(), sid)   # any [rows] vector
        v2.weight.weight_loader(v2.weight, cat[0], sid)
        v2.channel_scale.weight_loader(v2.channel_scale, cat[0][:, 0].contiguous(), sid)
        v2.block_scale.weight_loader(v2.block_scale, cat[1], sid)
        v2.qweight.weight_loader(v2.qweight, cat[2], sid)
        if not fused_on_disk:
            v2.weight_scale.weight_loader(v2.weight_scale, group[0][4], sid)


def _expected_rows(layer, tensors):
    """The v1 contract table: each matrix sliced at rank r (q) or r // replicas (k, v)."""
    parts = []
    for i, t in enumerate(tensors):
        size = t.shape[0] // layer.tp_size if not isinstance(layer, QKVParallelLinear) or i == 0 \
            else t.shape[0] // layer.total_num_kv_heads * layer.num_kv_heads
        block = layer.tp_rank if i == 0 or not isinstance(layer, QKVParallelLinear) \
            else layer.tp_rank // layer.num_kv_head_replicas
        parts.append(t[block * size:(block + 1) * size])
    return torch.cat(parts)


TP = [(0, 1), (1, 2)]


@pytest.fixture(params=TP, ids=["tp1", "tp2_rank1"])
def tp(request, monkeypatch):
    rank, size = request.param
    monkeypatch.setattr(linear_module, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(linear_module, "get_tensor_model_parallel_world_size", lambda: size)
    with layer_context():
        yield rank, size


@pytest.mark.parametrize("fused_on_disk", [False, True], ids=["per_shard", "fused"])
@pytest.mark.parametrize("kind", ["merged", "qkv_replicated_kv"])
def test_fused_layers(tp, kind, fused_on_disk):
    def build(quant_config):
        if kind == "merged":
            return MergedColumnParallelLinear(32, [64, 64], bias=True, quant_config=quant_config)
        return QKVParallelLinear(32, 16, 4, 1, bias=True, quant_config=quant_config)

    v1, v2 = build(None), build(V2Config())
    assert v2.weight.weight_loader == v2.weight_loader_v2 and v1.weight.weight_loader == v1.weight_loader
    assert v2.bias.weight_loader == v2.weight_loader      # the bias stays on v1
    shards = _shards(v2, 32)
    _load_fused(v1, v2, shards, fused_on_disk)
    torch.testing.assert_close(v2.weight.data, v1.weight.data, rtol=0, atol=0)
    torch.testing.assert_close(v2.channel_scale.data, v1.bias.data, rtol=0, atol=0)
    torch.testing.assert_close(v2.block_scale.data, _expected_rows(v2, [s[2] for s in shards]))
    assert torch.equal(v2.qweight.data, _expected_rows(v2, [s[3] for s in shards]))
    if not fused_on_disk:
        assert v2.weight_scale.tolist() == [float(i + 1) for i in range(len(shards))]


def test_fused_per_tensor_scale_fills_every_slot(tp):
    qkv = QKVParallelLinear(32, 16, 4, 1, bias=False, quant_config=V2Config())
    qkv.weight_scale.weight_loader(qkv.weight_scale, torch.tensor(0.5))
    assert qkv.weight_scale.tolist() == [0.5, 0.5, 0.5]


def test_column_row_replicated(tp):
    rank, size = tp
    w = _rand(64, 64, seed=1)
    col = ColumnParallelLinear(64, 64, bias=False, quant_config=V2Config())
    col.weight.weight_loader(col.weight, w)
    assert torch.equal(col.weight.data, w.chunk(size)[rank])
    col.weight_scale.weight_loader(col.weight_scale, torch.tensor(2.0))
    assert col.weight_scale.tolist() == [2.0]

    row = RowParallelLinear(64, 64, bias=False, quant_config=V2Config())
    row.weight.weight_loader(row.weight, w)
    assert torch.equal(row.weight.data, w.chunk(size, dim=1)[rank])
    blocks = _rand(4, 4, seed=2)
    row.block_scale.weight_loader(row.block_scale, blocks)
    assert torch.equal(row.block_scale.data, blocks.chunk(size, dim=1)[rank])
    packed = torch.arange(64 * 32, dtype=torch.int32).reshape(64, 32)
    row.qweight.weight_loader(row.qweight, packed)
    assert torch.equal(row.qweight.data, packed.chunk(size, dim=1)[rank])
    assert row.channel_scale.shape == (64,)       # row layers keep every output channel
    row.channel_scale.weight_loader(row.channel_scale, w[:, 0].contiguous())
    assert torch.equal(row.channel_scale.data, w[:, 0])

    rep = ReplicatedLinear(64, 64, bias=False, quant_config=V2Config())
    rep.weight.weight_loader(rep.weight, w)
    assert torch.equal(rep.weight.data, w)           # whole on every rank
    rep.weight_scale.weight_loader(rep.weight_scale, torch.tensor(3.0))
    assert rep.weight_scale.tolist() == [3.0]


def test_unquantized_layers_stay_on_v1():
    with layer_context():
        layer = MergedColumnParallelLinear(32, [64, 64], bias=False)
    assert type(layer.weight) is torch.nn.Parameter
    assert layer.weight.weight_loader == layer.weight_loader
