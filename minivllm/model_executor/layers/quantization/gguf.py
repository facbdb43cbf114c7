"""GGUF weights executed in their own block formats (`quantization="gguf"`, the default for .gguf).

The GGUF loader yields every 2-D weight as `<module>.qweight`: a view of the file's uint8 block
rows `[rows, row_bytes]` (or a float tensor for F32/F16/BF16), carrying its `gguf_type`. The
methods here keep those bytes packed: each shard's part for this rank (rows for column-parallel
layers and the vocabulary, whole blocks of input columns for row-parallel ones) is copied as it
arrives into the layer's one buffer, which becomes the `qweight` Parameter `[out/T, row_bytes/T]`
with `layer.qweight_type`, multiplied by `kernels/gguf_linear.py`. No dequantised copy is kept;
the tied LM head shares the embedding's packed Parameter.
"""

from typing import Any

import gguf
import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm.model_executor.kernels.cpu_linear import dispatch_linear, pack_for_cpu
from minivllm.model_executor.kernels.gguf_linear import (GGUF_FLOAT_TYPES, check_gguf_type,
                                                         gguf_embedding, gguf_linear,
                                                         gguf_matmul, gguf_repack_for_cpu)
from minivllm.model_executor.layers.quantization.base_config import (QuantizationConfig,
                                                                     QuantizeMethodBase,
                                                                     is_layer_skipped)
from minivllm.model_executor.layers.quantization.gguf_moe import GGUFMoEMethod
from minivllm.model_executor.layers.quantization.gguf_sharding import gguf_split_columns
from minivllm.model_executor.layers.quantization.unquantized import (UnquantizedEmbeddingMethod,
                                                                     UnquantizedLinearMethod)
from minivllm.model_executor.parameter import set_weight_attrs



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
        if "GateLinear" in bases:     # MoE routers: the packed reader dequantises them
            return UnquantizedLinearMethod()
        if "LinearBase" in bases:
            return UnquantizedLinearMethod() if skipped else GGUFLinearMethod(prefix)
        if "RoutedExperts" in bases:                       # FusedMoE and MoERunner experts
            return None if skipped else GGUFMoEMethod(prefix)
        return None


def _shard_rows(layer: nn.Module, shard_id: Any, full_rows: int) -> tuple[int, int, int]:
    """(row offset in this rank's fused weight, first source row, rows) of this rank's part of
    one checkpoint matrix."""
    rank, size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    if hasattr(layer, "shard_indices"):                      # vocabulary rows
        start = layer.shard_indices.org_vocab_start_index
        return 0, start, layer.shard_indices.org_vocab_end_index - start
    if shard_id in ("q", "k", "v"):
        offset, rows, start = layer._shard_layout(shard_id)
        return offset, start, rows
    if isinstance(shard_id, int):
        rows = layer.output_sizes[shard_id] // size
        return sum(layer.output_sizes[:shard_id]) // size, rank * rows, rows
    if type(layer).__name__ == "RowParallelLinear" or not hasattr(layer, "output_partition_sizes"):
        return 0, 0, full_rows                               # all output rows on every rank
    rows = sum(layer.output_partition_sizes)
    return 0, rank * rows if full_rows > rows else 0, rows


def _input_columns(layer: nn.Module, qtype: int, row_width: int) -> slice:
    """This rank's columns of a row (bytes for block types, elements for float types):
    row-parallel layers split the input, in whole blocks (else a ValueError naming valid sizes)."""
    if type(layer).__name__ != "RowParallelLinear":
        return slice(0, row_width)
    return gguf_split_columns(qtype, row_width, layer.input_size, layer.tp_size, layer.tp_rank,
                              f"{layer._gguf_prefix} (input size {layer.input_size})")


def _store(layer: nn.Module, qtype: int, offset: int, part: torch.Tensor) -> None:
    """Copy one shard's rows (this rank's part) to their final place.

    The first shard's type gets one buffer for all of this rank's rows (its row width is known
    only now), so the usual case ends as one packed matrix with no intermediate copy; a shard of
    another type (llama.cpp's mixed K-quant files give q and k/v different types) is kept in a
    buffer of its own and multiplied separately."""
    dtype = layer._gguf_dtype if qtype in GGUF_FLOAT_TYPES else torch.uint8
    state = layer.__dict__.setdefault("_gguf_load", {"dest": None, "qtype": qtype, "runs": [],
                                                     "others": {}})
    if state["dest"] is None:
        rows = getattr(layer, "num_embeddings_per_partition", None) \
            or sum(layer.output_partition_sizes)
        # Untouched rows cost no memory; padded vocabulary rows are zeroed after loading.
        state["dest"] = torch.empty(rows, part.shape[1], dtype=dtype)
    if qtype == state["qtype"]:
        state["dest"][offset:offset + part.shape[0]].copy_(part)
        state["runs"].append((offset, part.shape[0]))
    else:
        state["others"][offset] = (qtype, part.to(dtype, copy=True))


def _make_loader(layer: nn.Module):
    """The `qweight` loader: copy this rank's part of each shard, packed, into its final place
    (no intermediate copies: peak memory is what the packed weights need)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        qtype = int(getattr(loaded, "gguf_type", gguf.GGMLQuantizationType.F32))
        if qtype not in GGUF_FLOAT_TYPES:
            check_gguf_type(qtype, layer._gguf_prefix)   # a type without a kernel is never dequantised
        if shard_id is None and hasattr(layer, "_shard_layout") and loaded.shape[0] > getattr(
                layer, "output_size_per_partition", 0):
            raise ValueError(f"{layer._gguf_prefix}: a fused q/k/v GGUF tensor is not supported")
        offset, start, rows = _shard_rows(layer, shard_id, loaded.shape[0])
        part = loaded.narrow(0, start, rows)
        part = part[:, _input_columns(layer, qtype, part.shape[1])]
        _store(layer, qtype, offset, part)

    return load


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
        layer.qweight_type = -1
        layer.qweight_kernel_type = -1    # what the kernels take: qweight_type + its layout
        layer._gguf_dtype = params_dtype
        layer._gguf_prefix = self.prefix

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        state = layer.__dict__.pop("_gguf_load", None)
        if state is None:
            return   # tied LM head (its rows belong to the embedding) or nothing loaded
        dest, qtype = state["dest"], state["qtype"]
        loaded = sum(rows for _, rows in state["runs"])
        if not state["others"] and loaded < dest.shape[0]:
            dest[loaded:].zero_()             # padded vocabulary rows decode to 0 in every type
        segments = sorted([(o, r, qtype, dest[o:o + r]) for o, r in state["runs"]]
                          + [(o, t.shape[0], q, t) for o, (q, t) in state["others"].items()],
                          key=lambda seg: seg[0])
        if state["others"]:
            # Mixed types: [(qtype, weight rows)] in row order, multiplied one by one.
            layer.__dict__["_gguf_segments"] = [(q, t) for _, _, q, t in segments]
        layer.qweight.data = dest             # in place: a tied LM head shares this Parameter
        # Packed weights are already in their final allocation: moving them into the worker's
        # huge-page arena would hold two copies at the peak.
        layer.qweight.keep_in_place = True
        layer.qweight_type = qtype
        # CPUs with the x8 kernels (AVX2, AVX-512 VNNI): the x8 layout of the same bytes
        # (gguf_linear.gguf_repack_for_cpu)
        layer.qweight_kernel_type = qtype if state["others"] else gguf_repack_for_cpu(dest, qtype)
        if qtype in GGUF_FLOAT_TYPES and not state["others"]:
            layer.weight = layer.qweight      # plain weight: the unquantized CPU routing
            pack_for_cpu(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        segments = layer.__dict__.get("_gguf_segments")
        if segments is not None:
            return _segmented_matmul(x, segments, bias)
        if layer.qweight_type in GGUF_FLOAT_TYPES:
            return dispatch_linear(layer, x, bias)
        return gguf_matmul(x, layer.qweight, layer.qweight_kernel_type, bias)


def _segmented_matmul(x: torch.Tensor, segments: list[tuple[int, torch.Tensor]],
                      bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] @ [W_1 | W_2 | ...]^T for a fused layer whose shards have different types: [T,
    rows_1 | rows_2 | ...], one product per type in row order. Eager CPU steps write each
    product straight into its columns (native calls only, so a CPU graph can record them)."""
    if (x.dim() != 2 or torch.compiler.is_compiling()
            or any(q in GGUF_FLOAT_TYPES for q, _ in segments)):
        y = torch.cat([gguf_matmul(x, w, q, None) for q, w in segments], dim=-1)
        return y if bias is None else y + bias
    y = x.new_empty(x.shape[0], sum(w.shape[0] for _, w in segments))
    start = 0
    for q, w in segments:
        rows = w.shape[0]
        part_bias = None if bias is None else bias[start:start + rows]
        gguf_linear(x, w, q, part_bias, out=y[:, start:start + rows])
        start += rows
    return y


class GGUFLinearMethod(_GGUFMethodBase):
    """`x @ W^T` on the packed GGUF blocks of a linear layer."""


class GGUFEmbeddingMethod(_GGUFMethodBase):
    """Row lookup + dequantise of the packed vocabulary; as an LM head, the same linear kernel."""

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        qtype = layer.qweight_kernel_type
        if qtype in GGUF_FLOAT_TYPES:
            return F.embedding(input_, layer.qweight)
        if torch.compiler.is_compiling():
            return torch.ops.minivllm.gguf_embedding(input_, layer.qweight, qtype,
                                                     layer._gguf_dtype)
        return gguf_embedding(input_, layer.qweight, qtype, layer._gguf_dtype)

    def tie_weights(self, layer: nn.Module, embed_tokens: nn.Module) -> nn.Module:
        """The LM head multiplies by the embedding's packed rows: share the Parameter (filled in
        place after loading) and read its type from the embedding."""
        if not isinstance(embed_tokens.quant_method, GGUFEmbeddingMethod):
            raise ValueError("a GGUF LM head can only be tied to a GGUF embedding")
        layer.qweight = embed_tokens.qweight
        layer.__dict__["_gguf_tied_to"] = embed_tokens   # a plain reference, not a submodule
        return layer

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        # As an LM head: x holds the sampled positions, a row per request (int8 tiles for any
        # count where decode steps take them: gguf_int8_max_rows).
        source = getattr(layer, "_gguf_tied_to", layer)
        return gguf_matmul(x, source.qweight, source.qweight_kernel_type, bias,
                           independent_rows=True)
