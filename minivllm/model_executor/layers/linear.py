"""Tensor-parallel linear layers (contract section 2).

Notation: T = TP size, r = TP rank. Weights are `[out, in]` (`output_dim=0`, `input_dim=1`); each
rank holds only its shard, and every parameter's `weight_loader` narrows the full checkpoint tensor
to this rank's slice. `forward` returns `(output, output_bias)` unless `return_bias=False`.
Quant methods listed in `WEIGHT_LOADER_V2_SUPPORTED` get `weight_loader_v2` instead: their
parameters (`parameter.BasevLLMParameter`) narrow themselves (`linear_v2_loader.py`).
"""

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from minivllm.distributed import (divide, get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size,
                                  tensor_model_parallel_all_gather,
                                  tensor_model_parallel_all_reduce)
from minivllm.model_executor.custom_op import PluggableLayer
from minivllm.model_executor.layers import linear_v2_loader as v2
from minivllm.model_executor.layers.linear_dcp import DCPGroupColumnParallelLinear
from minivllm.model_executor.layers.quantization import (QuantizationConfig,
                                                         UnquantizedLinearMethod,
                                                         resolve_quant_method)
from minivllm.model_executor.parameter import (WEIGHT_LOADER_V2_SUPPORTED, default_weight_loader,
                                              set_weight_attrs)

__all__ = [
    "ColumnParallelLinear", "DCPGroupColumnParallelLinear", "LinearBase", "MergedColumnParallelLinear", "QKVParallelLinear",
    "ReplicatedLinear", "RowParallelLinear", "UnquantizedLinearMethod",
    "WEIGHT_LOADER_V2_SUPPORTED", "set_weight_attrs",
]

LinearOutput = torch.Tensor | tuple[torch.Tensor, nn.Parameter | None]


class LinearBase(PluggableLayer):
    """Shared setup: TP rank/size, params dtype, quant method, the `(output, bias)` convention."""

    requires_unquantized_input = False

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False, tp_rank: int | None = None,
                 tp_size: int | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.has_bias = bias
        self.skip_bias_add = skip_bias_add
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_config = quant_config
        self.prefix = prefix
        self.return_bias = return_bias
        self.disable_tp = disable_tp
        if disable_tp:
            self.tp_rank, self.tp_size = 0, 1
        else:
            self.tp_rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
            self.tp_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        if quant_config is None:
            self.quant_method = UnquantizedLinearMethod()
        else:
            self.quant_method = resolve_quant_method(quant_config, self, prefix)
            if self.quant_method is None:
                raise ValueError("All linear layers should support quant method.")

    def _create_weights_loader(self) -> Callable[..., None]:
        """What `create_weights` attaches: `weight_loader_v2` for v2 quant methods, else v1."""
        v2_method = v2.uses_weight_loader_v2(self.quant_method)
        return self.weight_loader_v2 if v2_method else self.weight_loader

    def update_param_tp_status(self) -> None:
        """Stamp this layer's TP coordinates on its parameters (re-run after post-processing)."""
        for param in self.parameters():
            param.tp_rank = self.tp_rank
            param.tp_size = self.tp_size

    def _make_bias(self, size: int) -> None:
        if not self.has_bias:
            self.register_parameter("bias", None)
            return
        self.bias = nn.Parameter(torch.empty(size, dtype=self.params_dtype), requires_grad=False)
        set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})

    def _output(self, output: torch.Tensor) -> LinearOutput:
        output_bias = self.bias if self.skip_bias_add else None
        return (output, output_bias) if self.return_bias else output

    def _load_rank_slice(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                         split_dim: int | None) -> None:
        """Copy this rank's slice of a full checkpoint tensor: along `split_dim` (the param's
        `output_dim` for column-parallel, `input_dim` for row-parallel; None = whole tensor)
        unless the checkpoint is already sharded (`is_sharded_weight`)."""
        if split_dim is not None and not getattr(param, "is_sharded_weight", False):
            shard_size = param.shape[split_dim]
            loaded_weight = loaded_weight.narrow(split_dim, self.tp_rank * shard_size, shard_size)
        if loaded_weight.dim() == 0:
            loaded_weight = loaded_weight.reshape(1)
        default_weight_loader(param, loaded_weight)


@PluggableLayer.register("replicated_linear")
class ReplicatedLinear(LinearBase):
    """A full, unsharded linear layer on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False) -> None:
        super().__init__(input_size, output_size, bias, skip_bias_add, params_dtype, quant_config,
                         prefix, return_bias=return_bias, disable_tp=disable_tp)
        self.output_partition_sizes = [output_size]
        self.quant_method.create_weights(self, input_size, [output_size], input_size, output_size,
                                         self.params_dtype, weight_loader=self._create_weights_loader())
        self._make_bias(output_size)
        self.update_param_tp_status()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        self._load_rank_slice(param, loaded_weight, split_dim=None)

    def weight_loader_v2(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        v2.load_replicated(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> LinearOutput:
        bias = self.bias if not self.skip_bias_add else None
        return self._output(self.quant_method.apply(self, x, bias))

    def extra_repr(self) -> str:
        return f"in_features={self.input_size}, output_features={self.output_size}, bias={self.has_bias}"


@PluggableLayer.register("column_parallel_linear")
class ColumnParallelLinear(LinearBase):
    """`Y = X A` with A split by output columns: rank r holds rows `[r*out/T, (r+1)*out/T)` of W."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 output_sizes: list[int] | None = None, return_bias: bool = True,
                 disable_tp: bool = False, tp_rank: int | None = None,
                 tp_size: int | None = None) -> None:
        super().__init__(input_size, output_size, bias, skip_bias_add, params_dtype, quant_config,
                         prefix, return_bias=return_bias, disable_tp=disable_tp, tp_rank=tp_rank,
                         tp_size=tp_size)
        self.gather_output = gather_output
        self.input_size_per_partition = input_size
        self.output_size_per_partition = divide(output_size, self.tp_size)
        # One entry per logical matrix (gate/up, q/k/v) so quantized methods can keep per-shard state.
        self.output_sizes = output_sizes or [output_size]
        self.output_partition_sizes = [divide(s, self.tp_size) for s in self.output_sizes]
        self.quant_method.create_weights(self, self.input_size_per_partition,
                                         self.output_partition_sizes, input_size, output_size,
                                         self.params_dtype, weight_loader=self._create_weights_loader())
        self._make_bias(self.output_size_per_partition)
        self.update_param_tp_status()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        self._load_rank_slice(param, loaded_weight, split_dim=getattr(param, "output_dim", None))

    def weight_loader_v2(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        v2.load_column(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> LinearOutput:
        bias = self.bias if not self.skip_bias_add else None
        output = self.quant_method.apply(self, x, bias)  # [..., out/T]
        if self.gather_output and self.tp_size > 1:
            output = tensor_model_parallel_all_gather(output)  # [..., out]
        return self._output(output)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, output_features={self.output_size_per_partition}, "
                f"bias={self.has_bias}, tp_size={self.tp_size}, gather_output={self.gather_output}")


class _FusedShardsMixin:
    """`load_weights` for fused layers: the shard id travels on the tensor (`tensor.shard_id`)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str]:
        for name, loaded_weight in weights:
            shard_id = getattr(loaded_weight, "shard_id", None)
            self._validate_shard_id(shard_id)
            module_path, _, attr = name.rpartition(".")
            module = self.get_submodule(module_path) if module_path else self
            param = getattr(module, attr, None)
            if param is None and attr == "bias":
                continue  # e.g. a GPTQ checkpoint's zero bias for a bias-free layer
            if not isinstance(param, torch.Tensor):
                raise ValueError(f"{type(self).__name__} has no parameter {name!r}")
            weight_loader = getattr(param, "weight_loader", None)
            if weight_loader is None:
                default_weight_loader(param, loaded_weight)
            else:
                weight_loader(param, loaded_weight, shard_id)
            yield name

    def missing_shards(self, param: torch.Tensor) -> list:
        """Shard ids of `param` that no shard loaded while others did (q_proj.bias without
        k_proj.bias would leave the k rows silently zero)."""
        loaded = param.__dict__.get("_loaded_shards")
        return [] if loaded is None else [s for s in self.shard_ids() if s not in loaded]

    @staticmethod
    def _note_shard(param: torch.Tensor, shard: int | str) -> None:
        param.__dict__.setdefault("_loaded_shards", set()).add(shard)


class MergedColumnParallelLinear(_FusedShardsMixin, ColumnParallelLinear):
    """Several column-parallel matrices side by side (gate_up_proj); each one sharded separately.

    Local rows: `[gate_r | up_r]`, shard k at offset `sum(sizes[:k]) / T` with `sizes[k] / T` rows.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False) -> None:
        tp_size = 1 if disable_tp else get_tensor_model_parallel_world_size()
        assert all(size % tp_size == 0 for size in output_sizes), (
            f"output sizes {output_sizes} must all be divisible by the TP size {tp_size}")
        super().__init__(input_size, sum(output_sizes), bias, gather_output, skip_bias_add,
                         params_dtype, quant_config, prefix, output_sizes=list(output_sizes),
                         return_bias=return_bias, disable_tp=disable_tp)

    def shard_ids(self) -> list[int]:
        return list(range(len(self.output_sizes)))

    def _validate_shard_id(self, shard_id: int | tuple[int, ...] | None) -> None:
        n = len(self.output_sizes)
        if shard_id is None:
            return
        ids = shard_id if isinstance(shard_id, tuple) else (shard_id,)
        if not ids or not all(isinstance(i, int) and 0 <= i < n for i in ids):
            raise ValueError(f"Shard id should be between 0 and {n - 1} (or None, or a tuple of "
                             f"them), got shard id {shard_id!r}")
        if any(b != a + 1 for a, b in zip(ids, ids[1:])):
            raise ValueError(f"Shard id with multiple indices should be consecutive, got {shard_id!r}")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | tuple[int, ...] | None = None) -> None:
        self._validate_shard_id(loaded_shard_id)
        output_dim = getattr(param, "output_dim", None)
        if loaded_shard_id is None or isinstance(loaded_shard_id, tuple):
            if output_dim is None:  # a per-tensor value fused on disk
                default_weight_loader(param, loaded_weight)
                return
            # Fused on disk: cut at the global sizes and load each logical matrix on its own.
            ids = range(len(self.output_sizes)) if loaded_shard_id is None else loaded_shard_id
            offset = 0
            for shard in ids:
                size = self.output_sizes[shard]
                self.weight_loader(param, loaded_weight.narrow(output_dim, offset, size), shard)
                offset += size
            return
        if output_dim is None:
            default_weight_loader(param, loaded_weight)
            return
        self._note_shard(param, loaded_shard_id)
        shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        param_data = param.data.narrow(output_dim, shard_offset, shard_size)
        if not getattr(param, "is_sharded_weight", False):
            loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * shard_size, shard_size)
        default_weight_loader(param_data, loaded_weight)

    def weight_loader_v2(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                         loaded_shard_id: int | tuple[int, ...] | None = None) -> None:
        v2.load_merged_column(self, param, loaded_weight, loaded_shard_id)


class QKVParallelLinear(_FusedShardsMixin, ColumnParallelLinear):
    """Fused q/k/v projection; local rows `[q_r | k_r | v_r]`, each matrix sharded by heads.

    With T >= nKV every rank holds one KV head: rank r holds head `r // (T / nKV)`.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = True,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False,
                 v_head_size: int | None = None) -> None:
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.v_head_size = v_head_size if v_head_size is not None else head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = 1 if disable_tp else get_tensor_model_parallel_world_size()
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        # Global sizes count replicated KV heads once per rank so that each divides by T.
        output_sizes = [self.num_heads * head_size * tp_size,
                        self.num_kv_heads * head_size * tp_size,
                        self.num_kv_heads * self.v_head_size * tp_size]
        super().__init__(hidden_size, sum(output_sizes), bias, False, skip_bias_add, params_dtype,
                         quant_config, prefix, output_sizes=output_sizes,
                         return_bias=return_bias, disable_tp=disable_tp)

    def shard_ids(self) -> list[str]:
        return ["q", "k", "v"]

    def _validate_shard_id(self, shard_id: str | None) -> None:
        if shard_id not in (None, "q", "k", "v"):
            raise ValueError("Shard id for QKVParallelLinear should be 'q', 'k', or 'v', "
                             f"got shard id {shard_id!r}")

    def _shard_layout(self, shard_id: str) -> tuple[int, int, int]:
        """(destination row offset, rows, source start row) of one shard on this rank."""
        q_rows = self.num_heads * self.head_size
        k_rows = self.num_kv_heads * self.head_size
        if shard_id == "q":
            return 0, q_rows, self.tp_rank * q_rows
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        if shard_id == "k":
            return q_rows, k_rows, kv_rank * k_rows
        v_rows = self.num_kv_heads * self.v_head_size
        return q_rows + k_rows, v_rows, kv_rank * v_rows

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | None = None) -> None:
        self._validate_shard_id(loaded_shard_id)
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # a per-tensor value, fused or not
            default_weight_loader(param, loaded_weight)
            return
        if loaded_shard_id is None:
            # Fused on disk: q [0, nH*d), k [nH*d, (nH+nKV)*d), v after; recurse per shard.
            q_rows = self.total_num_heads * self.head_size
            k_rows = self.total_num_kv_heads * self.head_size
            v_rows = self.total_num_kv_heads * self.v_head_size
            for shard, offset, size in (("q", 0, q_rows), ("k", q_rows, k_rows),
                                        ("v", q_rows + k_rows, v_rows)):
                self.weight_loader(param, loaded_weight.narrow(output_dim, offset, size), shard)
            return
        self._note_shard(param, loaded_shard_id)
        shard_offset, shard_size, source_start = self._shard_layout(loaded_shard_id)
        param_data = param.data.narrow(output_dim, shard_offset, shard_size)
        if not getattr(param, "is_sharded_weight", False):
            loaded_weight = loaded_weight.narrow(output_dim, source_start, shard_size)
        default_weight_loader(param_data, loaded_weight)

    def weight_loader_v2(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                         loaded_shard_id: str | None = None) -> None:
        v2.load_qkv(self, param, loaded_weight, loaded_shard_id)


@PluggableLayer.register("row_parallel_linear")
class RowParallelLinear(LinearBase):
    """`Y = X A` with A split by input rows: rank r holds columns `[r*in/T, (r+1)*in/T)` of W.

    The bias is added on rank 0 only, before the all-reduce, so it is counted once.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = True, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, reduce_results: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False) -> None:
        super().__init__(input_size, output_size, bias, skip_bias_add, params_dtype, quant_config,
                         prefix, return_bias=return_bias, disable_tp=disable_tp)
        if not reduce_results and bias and not skip_bias_add:
            raise ValueError("When not reduce the results, adding bias to the results can lead "
                             "to incorrect results")
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.output_size_per_partition = output_size
        self.output_partition_sizes = [output_size]
        self.quant_method.create_weights(self, self.input_size_per_partition,
                                         self.output_partition_sizes, input_size, output_size,
                                         self.params_dtype, weight_loader=self._create_weights_loader())
        self._make_bias(output_size)  # not split: [out]
        self.update_param_tp_status()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        self._load_rank_slice(param, loaded_weight, split_dim=getattr(param, "input_dim", None))

    def weight_loader_v2(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        v2.load_row(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> LinearOutput:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]  # [..., in/T]
        bias = self.bias if self.tp_rank == 0 and not self.skip_bias_add else None
        output = self.quant_method.apply(self, x, bias)  # [..., out], a partial sum at T > 1
        if self.reduce_results and self.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output)
        return self._output(output)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size_per_partition}, output_features={self.output_size}, "
                f"bias={self.has_bias}, tp_size={self.tp_size}, reduce_results={self.reduce_results}")
