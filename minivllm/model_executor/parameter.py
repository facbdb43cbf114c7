"""Parameter helpers: loader metadata, the default loader, and vLLM's "v2" parameter classes.

Two loading styles, as in vLLM:
- v1: a plain `nn.Parameter` carrying `output_dim` / `input_dim` / `weight_loader` attributes; the
  layer's `weight_loader` narrows the checkpoint tensor (unquantized weights, every bias).
- v2: a `BasevLLMParameter` subclass that knows its own layout and loads itself
  (`load_column_parallel_weight`, `load_merged_column_weight`, `load_qkv_weight`,
  `load_row_parallel_weight`); the layer's `weight_loader_v2` only computes shard offsets. Quant
  methods whose class name is in `WEIGHT_LOADER_V2_SUPPORTED` get the v2 loader.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Parameter

from minivllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size, model_parallel_is_initialized)

__all__ = [
    "BasevLLMParameter", "BlockQuantScaleParameter", "ChannelQuantScaleParameter",
    "GroupQuantScaleParameter", "ModelWeightParameter", "PackedColumnParameter",
    "PackedvLLMParameter", "PerTensorScaleParameter", "RowvLLMParameter",
    "WEIGHT_LOADER_V2_SUPPORTED", "composed_weight_loader", "default_weight_loader",
    "register_weight_loader_v2_supported_method", "row_parallel_weight_loader", "set_weight_attrs",
    "sharded_weight_loader",
]

# `loader(param, loaded_weight)`: what every `weight_loader` attribute holds.
LoaderFunction = Callable[[torch.Tensor, torch.Tensor], None]

# Class names of the linear quant methods whose parameters load through `weight_loader_v2`.
WEIGHT_LOADER_V2_SUPPORTED: list[str] = []


def register_weight_loader_v2_supported_method(cls: type) -> type:
    """Class decorator: linears with this quant method pass `weight_loader_v2` to create_weights."""
    if cls.__name__ not in WEIGHT_LOADER_V2_SUPPORTED:
        WEIGHT_LOADER_V2_SUPPORTED.append(cls.__name__)
    return cls


def set_weight_attrs(weight: torch.Tensor, weight_attrs: dict[str, Any] | None) -> None:
    """Set loader metadata on a parameter; an attribute is never silently overwritten."""
    if weight_attrs is None:
        return
    for key, value in weight_attrs.items():
        assert not hasattr(weight, key), f"Overwriting existing tensor attribute: {key}"
        setattr(weight, key, value)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into `param` (the loader of unsharded parameters)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        # Scalars may arrive as [] or [1]; take the value whatever its shape.
        param.data.copy_(loaded_weight.reshape(param.shape))
        return
    assert param.size() == loaded_weight.size(), (
        f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})")
    param.data.copy_(loaded_weight)


def sharded_weight_loader(shard_axis: int) -> LoaderFunction:
    """A loader that keeps this TP rank's slice of the checkpoint tensor along `shard_axis`
    (slice size = the parameter's size on that axis)."""

    def loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        shard_size = param.data.shape[shard_axis]
        start = get_tensor_model_parallel_rank() * shard_size
        default_weight_loader(param, loaded_weight.narrow(shard_axis, start, shard_size))

    return loader


def row_parallel_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Split along the parameter's `input_dim` when it has one (row parallel), else copy whole."""
    input_dim = getattr(param, "input_dim", None)
    if input_dim is None:
        default_weight_loader(param, loaded_weight)
        return
    sharded_weight_loader(input_dim)(param, loaded_weight)


def composed_weight_loader(loader: LoaderFunction,
                           fn: Callable[[torch.Tensor], torch.Tensor]) -> LoaderFunction:
    """`loader`, then `param = fn(param)` in place (e.g. `-exp(A_log)` for Mamba's A)."""

    def composed(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        loader(param, loaded_weight)
        param.data.copy_(fn(param))

    return composed


_QKV_INDEX = {"q": 0, "k": 1, "v": 2}


class BasevLLMParameter(Parameter):
    """A parameter that loads a checkpoint tensor into itself (vLLM's v2 loader); never trained.

    `tp_rank` / `tp_size` are read from the TP group here (0 / 1 before it exists) and re-stamped
    by the owning layer (`LinearBase.update_param_tp_status`, which also honours `disable_tp`).
    """

    def __new__(cls, data: torch.Tensor, **kwargs: Any) -> "BasevLLMParameter":
        return super().__new__(cls, data=data, requires_grad=False)

    def __init__(self, data: torch.Tensor, weight_loader: Callable[..., None]) -> None:
        self._weight_loader = weight_loader
        initialized = model_parallel_is_initialized()
        self.tp_rank = get_tensor_model_parallel_rank() if initialized else 0
        self.tp_size = get_tensor_model_parallel_world_size() if initialized else 1

    @property
    def weight_loader(self) -> Callable[..., None]:
        return self._weight_loader

    def _assert_and_load(self, loaded_weight: torch.Tensor) -> None:
        # A scalar on disk ([] or [1]) may fill a one-element parameter.
        scalar_ok = self.data.numel() == 1 and loaded_weight.numel() == 1
        assert self.data.shape == loaded_weight.shape or scalar_ok, (
            f"{type(self).__name__}: cannot load {tuple(loaded_weight.shape)} into "
            f"{tuple(self.data.shape)}")
        self.data.copy_(loaded_weight.reshape(self.data.shape))

    # Replicated tensors: every load is a whole copy. Subclasses narrow to their shard.
    def load_column_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        self._assert_and_load(loaded_weight)

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        self._assert_and_load(loaded_weight)

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, **kwargs: Any) -> None:
        self._assert_and_load(loaded_weight)

    def load_qkv_weight(self, loaded_weight: torch.Tensor, **kwargs: Any) -> None:
        self._assert_and_load(loaded_weight)

    @staticmethod
    def _shard_id_as_int(shard_id: str | int) -> int:
        if isinstance(shard_id, int):
            return shard_id
        if shard_id not in _QKV_INDEX:
            raise ValueError(f"Unknown shard id {shard_id!r}; expected an int or 'q', 'k', 'v'")
        return _QKV_INDEX[shard_id]


class _ColumnvLLMParameter(BasevLLMParameter):
    """Sharded along `output_dim`: rank r holds rows `[r*n, (r+1)*n)` of each logical matrix."""

    def __init__(self, output_dim: int, **kwargs: Any) -> None:
        self._output_dim = output_dim
        super().__init__(**kwargs)

    @property
    def output_dim(self) -> int:
        return self._output_dim

    def _packed_along_output(self, shard_offset: int, shard_size: int) -> tuple[int, int]:
        # Packed int4 weights hold `packed_factor` values per element along `packed_dim`.
        if getattr(self, "packed_dim", None) == self.output_dim:
            return self.adjust_shard_indexes_for_packing(shard_size=shard_size,
                                                         shard_offset=shard_offset)[::-1]
        return shard_offset, shard_size

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        shard_size = self.data.shape[self.output_dim]
        loaded_weight = loaded_weight.narrow(self.output_dim, self.tp_rank * shard_size, shard_size)
        self._assert_and_load(loaded_weight)

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, *, shard_offset: int,
                                  shard_size: int, **kwargs: Any) -> None:
        """Logical matrix k goes to local rows `[shard_offset, +shard_size)`, taken from rows
        `[r * shard_size, +shard_size)` of the checkpoint tensor."""
        shard_offset, shard_size = self._packed_along_output(shard_offset, shard_size)
        param_data = self.data.narrow(self.output_dim, shard_offset, shard_size)
        loaded_weight = loaded_weight.narrow(self.output_dim, self.tp_rank * shard_size, shard_size)
        assert param_data.shape == loaded_weight.shape, (param_data.shape, loaded_weight.shape)
        param_data.copy_(loaded_weight)

    def load_qkv_weight(self, loaded_weight: torch.Tensor, *, shard_id: str, shard_offset: int,
                        shard_size: int, num_heads: int = 1, **kwargs: Any) -> None:
        """`num_heads` is the KV-head replica count: rank r reads KV block `r // num_heads`."""
        shard_offset, shard_size = self._packed_along_output(shard_offset, shard_size)
        block = self.tp_rank if shard_id == "q" else self.tp_rank // num_heads
        param_data = self.data.narrow(self.output_dim, shard_offset, shard_size)
        loaded_weight = loaded_weight.narrow(self.output_dim, block * shard_size, shard_size)
        assert param_data.shape == loaded_weight.shape, (param_data.shape, loaded_weight.shape)
        param_data.copy_(loaded_weight)


class RowvLLMParameter(BasevLLMParameter):
    """Sharded along `input_dim` (row-parallel layers): rank r holds columns `[r*n, (r+1)*n)`."""

    def __init__(self, input_dim: int, **kwargs: Any) -> None:
        self._input_dim = input_dim
        super().__init__(**kwargs)

    @property
    def input_dim(self) -> int:
        return self._input_dim

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        # Packed along input_dim, `shard_size` counts packed elements, as the checkpoint does.
        shard_size = self.data.shape[self.input_dim]
        loaded_weight = loaded_weight.narrow(self.input_dim, self.tp_rank * shard_size, shard_size)
        if loaded_weight.dim() == 0:
            loaded_weight = loaded_weight.reshape(1)
        self._assert_and_load(loaded_weight)


class ModelWeightParameter(_ColumnvLLMParameter, RowvLLMParameter):
    """A weight `[out, in]`-like tensor sharded by the layer type (column or row)."""


class GroupQuantScaleParameter(_ColumnvLLMParameter, RowvLLMParameter):
    """Per-group scales / zero points `[out, in / group_size]` (or transposed): shard like the weight."""


class ChannelQuantScaleParameter(_ColumnvLLMParameter):
    """Per-output-channel scales `[out]` or `[out, 1]`: sharded with the rows, whole on row layers."""


class BlockQuantScaleParameter(_ColumnvLLMParameter, RowvLLMParameter):
    """Block-wise scales `[ceil(out / bn), ceil(in / bk)]`. The layer gives shard offsets and sizes
    in units of blocks (it reads `layer.weight_block_size`)."""


class PerTensorScaleParameter(BasevLLMParameter):
    """One scale per logical matrix of a fused layer: `[num_shards]`, q/k/v -> 0/1/2, gate/up -> 0/1.

    Unfused layers hold one entry. A scale fused on disk (no shard id) fills every entry.
    """

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        self._load_everywhere(loaded_weight)

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        self._load_everywhere(loaded_weight)

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, *,
                                  shard_id: int | None = None, **kwargs: Any) -> None:
        self._load_into_shard_id(loaded_weight, shard_id)

    def load_qkv_weight(self, loaded_weight: torch.Tensor, *, shard_id: str | None = None,
                        **kwargs: Any) -> None:
        self._load_into_shard_id(loaded_weight, shard_id)

    def _load_everywhere(self, loaded_weight: torch.Tensor) -> None:
        assert loaded_weight.numel() == 1, f"a per-tensor scale has one value, got {loaded_weight.shape}"
        self.data.fill_(loaded_weight.reshape(()).item())

    def _load_into_shard_id(self, loaded_weight: torch.Tensor, shard_id: str | int | None) -> None:
        if shard_id is None:
            self._load_everywhere(loaded_weight)
            return
        assert loaded_weight.numel() == 1, f"a per-tensor scale has one value, got {loaded_weight.shape}"
        self.data[self._shard_id_as_int(shard_id)].copy_(loaded_weight.reshape(()))


class _PackedMixin:
    """Shard bookkeeping of tensors packing `packed_factor` values per element along `packed_dim`."""

    _packed_factor: int | Any
    _packed_dim: int

    @property
    def packed_factor(self) -> int | Any:
        return self._packed_factor

    @property
    def packed_dim(self) -> int:
        return self._packed_dim

    def adjust_shard_indexes_for_packing(self, shard_size: int,
                                         shard_offset: int) -> tuple[int, int]:
        """(size, offset) in unpacked values -> in stored (packed) elements."""
        return shard_size // self.packed_factor, shard_offset // self.packed_factor


class PackedColumnParameter(_PackedMixin, _ColumnvLLMParameter):
    """Packed along `packed_dim` and sharded along `output_dim` (e.g. GPTQ zero points)."""

    def __init__(self, packed_factor: int | Any, packed_dim: int,
                 marlin_tile_size: int | None = None, **kwargs: Any) -> None:
        self._packed_factor, self._packed_dim = packed_factor, packed_dim
        self.marlin_tile_size = marlin_tile_size
        super().__init__(**kwargs)


class PackedvLLMParameter(_PackedMixin, ModelWeightParameter):
    """A packed weight (int4 in int32 / uint8): shard offsets along `packed_dim` are divided by
    `packed_factor`; along the other dim it shards like `ModelWeightParameter`."""

    def __init__(self, packed_factor: int | Any, packed_dim: int,
                 marlin_tile_size: int | None = None, **kwargs: Any) -> None:
        self._packed_factor, self._packed_dim = packed_factor, packed_dim
        self.marlin_tile_size = marlin_tile_size
        super().__init__(**kwargs)
