"""GGUF weights executed in their own block formats (`quantization="gguf"`, the default for .gguf).

The GGUF loader yields every 2-D weight as `<module>.qweight`: the file's uint8 block rows
`[rows, row_bytes]` (or a float tensor for F32/F16/BF16), carrying its `gguf_type`. The methods
here keep those bytes packed: each loaded shard is cut to this rank's part as it arrives
(rows for column-parallel layers and the vocabulary, whole blocks of input columns for
row-parallel ones), and after loading a layer's shards become one `qweight` Parameter
`[out/T, row_bytes/T...]` with `layer.qweight_type`, multiplied by `kernels/gguf_linear.py`.
No dequantised copy is kept; the tied LM head shares the embedding's packed rows.
"""

from typing import Any

import gguf
import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm.model_executor.kernels.cpu_linear import dispatch_linear, pack_for_cpu
from minivllm.model_executor.kernels.gguf_linear import (check_gguf_type, gguf_block_shape,
                                                         gguf_embedding, gguf_linear)
from minivllm.model_executor.layers.quantization.base_config import (QuantizationConfig,
                                                                     QuantizeMethodBase,
                                                                     is_layer_skipped)
from minivllm.model_executor.layers.quantization.unquantized import (UnquantizedEmbeddingMethod,
                                                                     UnquantizedLinearMethod)
from minivllm.model_executor.parameter import set_weight_attrs

_FLOAT_TYPES = {int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.F16),
                int(gguf.GGMLQuantizationType.BF16)}


class GGUFConfig(QuantizationConfig):
    """Per-tensor GGUF types; `unquantized_modules` (prefixes) keep plain weights."""

    def __init__(self, unquantized_modules: list[str] | None = None) -> None:
        super().__init__()
        self.unquantized_modules = list(unquantized_modules or [])

    def get_name(self) -> str:
        return "gguf"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []   # the types are in the .gguf file itself

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GGUFConfig":
        return cls(config.get("unquantized_modules"))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        skipped = is_layer_skipped(prefix, self.unquantized_modules, self.packed_modules_mapping,
                                   match_mode="substring")
        # By class name: the layer modules import this package, so it cannot import them.
        bases = {cls.__name__ for cls in type(layer).__mro__}
        if "VocabParallelEmbedding" in bases:                 # also the LM head
            return UnquantizedEmbeddingMethod() if skipped else GGUFEmbeddingMethod(prefix)
        if "LinearBase" in bases:
            return UnquantizedLinearMethod() if skipped else GGUFLinearMethod(prefix)
        return None


def _shard_rows(layer: nn.Module, shard_id: Any, full_rows: int) -> tuple[Any, int, int]:
    """(shard key, first source row, rows) of this rank's part of one checkpoint matrix."""
    rank, size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    if hasattr(layer, "shard_indices"):                      # vocabulary rows
        start = layer.shard_indices.org_vocab_start_index
        return 0, start, layer.shard_indices.org_vocab_end_index - start
    if shard_id in ("q", "k", "v"):
        _, rows, start = layer._shard_layout(shard_id)
        return "qkv".index(shard_id), start, rows
    if isinstance(shard_id, int):
        rows = layer.output_sizes[shard_id] // size
        return shard_id, rank * rows, rows
    if type(layer).__name__ == "RowParallelLinear" or not hasattr(layer, "output_partition_sizes"):
        return 0, 0, full_rows                               # all output rows on every rank
    rows = sum(layer.output_partition_sizes)
    return 0, rank * rows if full_rows > rows else 0, rows


def _input_block_slice(layer: nn.Module, qtype: int, in_features: int, row_bytes: int) -> slice:
    """Byte columns of this rank's input columns (row-parallel); whole blocks or ValueError."""
    if type(layer).__name__ != "RowParallelLinear" or layer.tp_size == 1:
        return slice(0, row_bytes)
    block_elems, block_bytes = gguf_block_shape(qtype)
    per_rank = in_features // layer.tp_size
    if in_features % layer.tp_size or per_rank % block_elems:
        valid = [t for t in range(1, in_features + 1)
                 if in_features % t == 0 and (in_features // t) % block_elems == 0]
        raise ValueError(
            f"tensor_parallel_size={layer.tp_size} would split a {gguf.GGMLQuantizationType(qtype).name} "
            f"block ({block_elems} values) of {layer._gguf_prefix} (input size {in_features}); valid "
            f"tensor_parallel_size values for this layer: {valid}")
    width = per_rank // block_elems * block_bytes
    return slice(layer.tp_rank * width, (layer.tp_rank + 1) * width)


def _make_loader(layer: nn.Module):
    """The `qweight` loader: keep this rank's part of each shard, packed, until all arrived."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        qtype = int(getattr(loaded, "gguf_type", gguf.GGMLQuantizationType.F32))
        if qtype not in _FLOAT_TYPES:
            check_gguf_type(qtype, layer._gguf_prefix)   # a type without a kernel is never dequantised
        if shard_id is None and hasattr(layer, "_shard_layout") and loaded.shape[0] > getattr(
                layer, "output_size_per_partition", 0):
            raise ValueError(f"{layer._gguf_prefix}: a fused q/k/v GGUF tensor is not supported")
        key, start, rows = _shard_rows(layer, shard_id, loaded.shape[0])
        part = loaded.narrow(0, start, rows)
        if qtype in _FLOAT_TYPES:
            cols = _input_block_slice_float(layer, part.shape[1])
        else:
            cols = _input_block_slice(layer, qtype, layer.input_size, part.shape[1])
        layer._gguf_shards[key] = (qtype, part[:, cols].contiguous())

    return load


def _input_block_slice_float(layer: nn.Module, in_features: int) -> slice:
    if type(layer).__name__ != "RowParallelLinear" or layer.tp_size == 1:
        return slice(0, in_features)
    per_rank = in_features // layer.tp_size
    return slice(layer.tp_rank * per_rank, (layer.tp_rank + 1) * per_rank)


class _GGUFMethodBase(QuantizeMethodBase):
    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix     # named in load errors

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        # Shapes depend on each tensor's type, known only when it is loaded: an empty
        # placeholder now, filled in place after loading (so a tied LM head keeps sharing it).
        qweight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.register_parameter("qweight", qweight)
        set_weight_attrs(qweight, {"weight_loader": _make_loader(layer), "is_gguf_weight": True})
        layer._gguf_shards = {}
        layer.qweight_type = -1
        layer._gguf_dtype = params_dtype
        layer._gguf_prefix = self.prefix

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = layer.__dict__.pop("_gguf_shards", None)
        if not shards:
            return   # tied LM head (its rows belong to the embedding) or nothing loaded
        parts = [shards[k] for k in sorted(shards)]
        qtypes = {qtype for qtype, _ in parts}
        if len(qtypes) > 1:
            names = sorted(gguf.GGMLQuantizationType(q).name for q in qtypes)
            raise ValueError(f"{layer._gguf_prefix}: the shards of this fused layer have different "
                             f"GGUF types {names}; fused layers need one type")
        qtype = qtypes.pop()
        # [out/T, row_bytes]: rows of a fused layer are independent, so shards concatenate.
        packed = torch.cat([t for _, t in parts]) if len(parts) > 1 else parts[0][1]
        if qtype in _FLOAT_TYPES:
            packed = packed.to(layer._gguf_dtype)
        rows_needed = self._rows(layer)
        if packed.shape[0] < rows_needed:     # padded vocabulary: zero blocks decode to 0
            packed = torch.cat([packed, packed.new_zeros(rows_needed - packed.shape[0],
                                                         packed.shape[1])])
        layer.qweight.data = packed
        layer.qweight_type = qtype
        if qtype in _FLOAT_TYPES:
            layer.weight = layer.qweight      # plain weight: the unquantized CPU routing
            pack_for_cpu(layer)

    @staticmethod
    def _rows(layer: nn.Module) -> int:
        return getattr(layer, "num_embeddings_per_partition", 0)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        qtype = layer.qweight_type
        if qtype in _FLOAT_TYPES:
            return dispatch_linear(layer, x, bias)
        if torch.compiler.is_compiling():
            return torch.ops.minivllm.gguf_linear(x, layer.qweight, qtype, bias)
        return gguf_linear(x, layer.qweight, qtype, bias)


class GGUFLinearMethod(_GGUFMethodBase):
    """`x @ W^T` on the packed GGUF blocks of a linear layer."""


class GGUFEmbeddingMethod(_GGUFMethodBase):
    """Row lookup + dequantise of the packed vocabulary; as an LM head, the same linear kernel."""

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        qtype = layer.qweight_type
        if qtype in _FLOAT_TYPES:
            return F.embedding(input_, layer.qweight)
        return gguf_embedding(input_, layer.qweight, qtype, layer._gguf_dtype)

    def tie_weights(self, layer: nn.Module, embed_tokens: nn.Module) -> nn.Module:
        """The LM head multiplies by the embedding's packed rows: share the Parameter (filled in
        place after loading) and read its type from the embedding."""
        if not isinstance(embed_tokens.quant_method, GGUFEmbeddingMethod):
            raise ValueError("a GGUF LM head can only be tied to a GGUF embedding")
        layer.qweight = embed_tokens.qweight
        layer.__dict__.pop("_gguf_shards", None)
        layer.__dict__["_gguf_tied_to"] = embed_tokens   # a plain reference, not a submodule
        return layer

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        source = getattr(layer, "_gguf_tied_to", layer)
        qtype = source.qweight_type
        if qtype in _FLOAT_TYPES:
            return F.linear(x, source.qweight, bias)
        if torch.compiler.is_compiling():
            return torch.ops.minivllm.gguf_linear(x, source.qweight, qtype, bias)
        return gguf_linear(x, source.qweight, qtype, bias)
