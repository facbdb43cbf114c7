"""Linear layers: shard loading per rank (simulated TP) and forward against plain F.linear."""

import pytest
import torch
import torch.nn.functional as F

import minivllm.model_executor.layers.linear as linear_mod
from minivllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear, QKVParallelLinear,
                                                   ReplicatedLinear, RowParallelLinear)
from minivllm.model_executor.layers.quantization import QuantizationConfig
from tests.model_executor.layers._helpers import layer_context

H = 16


@pytest.fixture
def ctx():
    with layer_context() as config:
        yield config


def _simulate_tp(monkeypatch, rank: int, size: int) -> None:
    """Make the layers believe they are rank `rank` of `size` (collectives stay identities)."""
    monkeypatch.setattr(linear_mod, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(linear_mod, "get_tensor_model_parallel_world_size", lambda: size)


def _shard_id(tensor: torch.Tensor, shard_id) -> torch.Tensor:
    tensor.shard_id = shard_id
    return tensor


def test_replicated_linear_and_return_conventions(ctx):
    w, b, x = torch.randn(8, H), torch.randn(8), torch.randn(3, H)
    layer = ReplicatedLinear(H, 8, True)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    out, out_bias = layer(x)
    torch.testing.assert_close(out, F.linear(x, w, b))
    assert out_bias is None
    assert layer.weight.output_dim == 0 and layer.weight.input_dim == 1

    skip = ReplicatedLinear(H, 8, bias=True, skip_bias_add=True)
    skip.load_state_dict({"weight": w, "bias": b})
    out, out_bias = skip(x)
    torch.testing.assert_close(out, F.linear(x, w))
    assert out_bias is skip.bias

    bare = ColumnParallelLinear(H, 8, bias=False, return_bias=False)
    bare.weight.weight_loader(bare.weight, w)
    torch.testing.assert_close(bare(x), F.linear(x, w))


def test_column_parallel_shards_concatenate_to_full(ctx):
    w, b, x = torch.randn(12, H), torch.randn(12), torch.randn(3, H)
    outs = []
    for rank in range(3):
        layer = ColumnParallelLinear(H, 12, bias=True, tp_rank=rank, tp_size=3)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        assert layer.weight.shape == (4, H) and layer.weight.tp_rank == rank
        torch.testing.assert_close(layer.weight.data, w[4 * rank:4 * (rank + 1)])
        outs.append(layer(x)[0])
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.linear(x, w, b))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merged_column_shard_ids(ctx, monkeypatch, tp):
    sizes = [8, 16]
    gate, up, x = torch.randn(8, H), torch.randn(16, H), torch.randn(3, H)
    fused = torch.cat([gate, up])
    gate_outs, up_outs = [], []
    for rank in range(tp):
        _simulate_tp(monkeypatch, rank, tp)
        by_int = MergedColumnParallelLinear(H, sizes, bias=False)
        by_int.weight.weight_loader(by_int.weight, gate, 0)
        by_int.weight.weight_loader(by_int.weight, up, 1)
        for shard_id in (None, (0, 1)):
            other = MergedColumnParallelLinear(H, sizes, bias=False)
            other.weight.weight_loader(other.weight, fused, shard_id)
            torch.testing.assert_close(other.weight.data, by_int.weight.data)
        out = by_int(x)[0]  # [3, (8 + 16) / tp] = [gate_r | up_r]
        gate_outs.append(out[:, :8 // tp])
        up_outs.append(out[:, 8 // tp:])
    torch.testing.assert_close(torch.cat(gate_outs, -1), F.linear(x, gate))
    torch.testing.assert_close(torch.cat(up_outs, -1), F.linear(x, up))


def test_merged_column_load_weights_reads_tensor_shard_id(ctx):
    gate, up, x = torch.randn(8, H), torch.randn(8, H), torch.randn(3, H)
    layer = MergedColumnParallelLinear(H, [8, 8], bias=False)
    weights = [("weight", _shard_id(gate, 0)), ("weight", _shard_id(up, 1)),
               ("bias", _shard_id(torch.zeros(8), 0))]  # no bias in the layer: skipped
    assert list(layer.load_weights(weights)) == ["weight", "weight"]
    torch.testing.assert_close(layer(x)[0], F.linear(x, torch.cat([gate, up])))
    with pytest.raises(ValueError, match="between 0 and 1"):
        list(layer.load_weights([("weight", _shard_id(gate, 2))]))
    with pytest.raises(ValueError, match="consecutive"):
        layer.weight.weight_loader(layer.weight, gate, (1, 0))


@pytest.mark.parametrize("tp, n_kv", [(1, 2), (2, 2), (4, 2), (4, 1)])
def test_qkv_shards_and_kv_replication(ctx, monkeypatch, tp, n_kv):
    n_heads, d = 4, 4
    q = torch.randn(n_heads * d, H)
    k, v = torch.randn(n_kv * d, H), torch.randn(n_kv * d, H)
    bias = torch.randn((n_heads + 2 * n_kv) * d)
    x = torch.randn(3, H)
    for rank in range(tp):
        _simulate_tp(monkeypatch, rank, tp)
        layer = QKVParallelLinear(H, d, n_heads, n_kv, bias=True)
        for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, tensor, shard_id)
        layer.bias.weight_loader(layer.bias, bias)  # fused on disk (shard id None)
        heads = n_heads // tp
        if tp >= n_kv:  # one KV head per rank, shared by tp / n_kv ranks
            first_kv, kv_heads = rank // (tp // n_kv), 1
        else:
            first_kv, kv_heads = rank * (n_kv // tp), n_kv // tp
        kv_rows = slice(first_kv * d, (first_kv + kv_heads) * d)
        q_rows = slice(rank * heads * d, (rank + 1) * heads * d)
        expected_w = torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
        b_q, b_k, b_v = bias.split([n_heads * d, n_kv * d, n_kv * d])
        expected_b = torch.cat([b_q[q_rows], b_k[kv_rows], b_v[kv_rows]])
        torch.testing.assert_close(layer.weight.data, expected_w)
        torch.testing.assert_close(layer(x)[0], F.linear(x, expected_w, expected_b))
        fused = QKVParallelLinear(H, d, n_heads, n_kv, bias=False)
        fused.weight.weight_loader(fused.weight, torch.cat([q, k, v]))
        torch.testing.assert_close(fused.weight.data, expected_w)


def test_qkv_load_weights_and_bad_shard_id(ctx):
    q, k, v = torch.randn(16, H), torch.randn(8, H), torch.randn(8, H)
    layer = QKVParallelLinear(H, 4, 4, 2, bias=False)
    weights = [("weight", _shard_id(t, s)) for s, t in (("q", q), ("k", k), ("v", v))]
    weights.append(("bias", _shard_id(torch.zeros(16), "q")))
    assert list(layer.load_weights(weights)) == ["weight"] * 3
    torch.testing.assert_close(layer.weight.data, torch.cat([q, k, v]))
    with pytest.raises(ValueError, match="should be 'q', 'k', or 'v', got shard id 'x'"):
        layer.weight.weight_loader(layer.weight, q, "x")


@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_bias_on_rank0_only(ctx, monkeypatch, input_is_parallel):
    tp = 2
    w, b, x = torch.randn(H, 12), torch.randn(H), torch.randn(3, 12)
    partial_sums = []
    for rank in range(tp):
        _simulate_tp(monkeypatch, rank, tp)
        layer = RowParallelLinear(12, H, bias=True, input_is_parallel=input_is_parallel)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        assert layer.weight.shape == (H, 6) and layer.bias.shape == (H,)
        x_in = x[:, rank * 6:(rank + 1) * 6] if input_is_parallel else x
        partial_sums.append(layer(x_in)[0])  # what each rank feeds the all-reduce
    torch.testing.assert_close(sum(partial_sums), F.linear(x, w, b))


def test_row_parallel_errors_and_skip_bias(ctx):
    with pytest.raises(ValueError, match="When not reduce the results"):
        RowParallelLinear(8, 8, bias=True, reduce_results=False)
    layer = RowParallelLinear(8, 8, bias=True, reduce_results=False, skip_bias_add=True)
    layer.load_state_dict({"weight": torch.eye(8), "bias": torch.ones(8)})
    out, out_bias = layer(torch.ones(2, 8))
    torch.testing.assert_close(out, torch.ones(2, 8))
    assert out_bias is layer.bias


def test_quant_config_without_a_method_is_rejected(ctx):
    class NoMethod(QuantizationConfig):
        def get_name(self): return "none"
        def get_supported_act_dtypes(self): return [torch.float32]
        @classmethod
        def get_min_capability(cls): return 0
        @staticmethod
        def get_config_filenames(): return []
        @classmethod
        def from_config(cls, config): return cls()
        def get_quant_method(self, layer, prefix): return None

    with pytest.raises(ValueError, match="All linear layers should support quant method."):
        RowParallelLinear(8, 8, quant_config=NoMethod())
