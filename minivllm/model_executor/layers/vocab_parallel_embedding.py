"""Vocab-parallel embedding and LM head (contract section 2.6).

The vocabulary is padded to a multiple of 64 and split evenly: rank r owns rows
`[r * padded/T, (r+1) * padded/T)`. Ids outside a rank's range look up row 0 and are zeroed, so the
all-reduce over TP sums exactly one non-zero row per token.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from minivllm.distributed import GroupCoordinator, divide, get_tp_group
from minivllm.model_executor.custom_op import PluggableLayer
from minivllm.model_executor.layers.quantization import (QuantizationConfig, QuantizeMethodBase,
                                                         UnquantizedEmbeddingMethod,
                                                         method_has_implemented_embedding,
                                                         resolve_quant_method)
from minivllm.model_executor.parameter import set_weight_attrs

__all__ = [
    "DEFAULT_VOCAB_PADDING_SIZE", "ParallelLMHead", "UnquantizedEmbeddingMethod",
    "VocabParallelEmbedding", "VocabParallelEmbeddingShardIndices", "pad_vocab_size",
]

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int,
                                       offset: int = 0) -> tuple[int, int]:
    per_partition = divide(global_vocab_size, world_size)
    return offset + rank * per_partition, offset + (rank + 1) * per_partition


@dataclass
class VocabParallelEmbeddingShardIndices:
    """Which vocab ids one rank owns: an original-vocab range then an added-vocab (LoRA) range.

    The `padded_*` ranges are the rows the rank stores; the others are clipped to real ids.
    """

    padded_org_vocab_start_index: int
    padded_org_vocab_end_index: int
    padded_added_vocab_start_index: int
    padded_added_vocab_end_index: int
    org_vocab_start_index: int
    org_vocab_end_index: int
    added_vocab_start_index: int
    added_vocab_end_index: int

    @property
    def num_org_elements(self) -> int:
        return self.org_vocab_end_index - self.org_vocab_start_index

    @property
    def num_added_elements(self) -> int:
        return self.added_vocab_end_index - self.added_vocab_start_index

    @property
    def num_org_elements_padded(self) -> int:
        return self.padded_org_vocab_end_index - self.padded_org_vocab_start_index

    @property
    def num_added_elements_padded(self) -> int:
        return self.padded_added_vocab_end_index - self.padded_added_vocab_start_index

    @property
    def num_org_vocab_padding(self) -> int:
        return self.num_org_elements_padded - self.num_org_elements

    @property
    def num_elements_padded(self) -> int:
        return self.num_org_elements_padded + self.num_added_elements_padded


def _get_shard_indices(num_padded: int, org_padded: int, vocab_size: int, org_vocab_size: int,
                       tp_rank: int, tp_size: int) -> VocabParallelEmbeddingShardIndices:
    org_start, org_end = vocab_range_from_global_vocab_size(org_padded, tp_rank, tp_size)
    added_start, added_end = vocab_range_from_global_vocab_size(
        num_padded - org_padded, tp_rank, tp_size, offset=org_vocab_size)
    return VocabParallelEmbeddingShardIndices(
        org_start, org_end, added_start, added_end,
        min(org_start, org_vocab_size), min(org_end, org_vocab_size),
        min(added_start, vocab_size), min(added_end, vocab_size))


def get_masked_input_and_mask(input_: torch.Tensor, shard: VocabParallelEmbeddingShardIndices
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Map global ids to local rows; ids this rank does not own map to row 0 and are flagged."""
    org_mask = (input_ >= shard.org_vocab_start_index) & (input_ < shard.org_vocab_end_index)
    added_mask = (input_ >= shard.added_vocab_start_index) & (input_ < shard.added_vocab_end_index)
    # Added ids sit after this rank's padded original rows.
    added_offset = (shard.added_vocab_start_index - shard.num_org_elements
                    - shard.num_org_vocab_padding)
    valid_offset = shard.org_vocab_start_index * org_mask + added_offset * added_mask
    vocab_mask = org_mask | added_mask
    return vocab_mask * (input_ - valid_offset), ~vocab_mask


@PluggableLayer.register("vocab_parallel_embedding")
class VocabParallelEmbedding(PluggableLayer):
    """Token embedding whose (padded) vocabulary is split across TP ranks."""

    _is_lm_head = False

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None, org_num_embeddings: int | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 disable_tp: bool = False, reduce_results: bool = True,
                 quant_method: QuantizeMethodBase | None = None,
                 parallel_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        if parallel_group is None and not disable_tp:
            parallel_group = get_tp_group()
        self.tp_group = None if disable_tp and parallel_group is None else parallel_group
        self.tp_rank = self.tp_group.rank_in_group if self.tp_group is not None else 0
        self.tp_size = self.tp_group.world_size if self.tp_group is not None else 1
        self.reduce_results = reduce_results
        self.num_embeddings = num_embeddings
        self.padding_size = padding_size
        self.org_vocab_size = org_num_embeddings or num_embeddings
        num_added = num_embeddings - self.org_vocab_size
        self.org_vocab_size_padded = pad_vocab_size(self.org_vocab_size, padding_size)
        self.num_embeddings_padded = pad_vocab_size(self.org_vocab_size_padded + num_added,
                                                    padding_size)
        self.shard_indices = _get_shard_indices(
            self.num_embeddings_padded, self.org_vocab_size_padded, num_embeddings,
            self.org_vocab_size, self.tp_rank, self.tp_size)
        self.embedding_dim = embedding_dim
        self.quant_method = self._select_quant_method(quant_config, quant_method, prefix)
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size)
        assert self.shard_indices.num_elements_padded == self.num_embeddings_per_partition
        # Linear-style metadata, read by quantized methods and LoRA.
        self.input_size = self.input_size_per_partition = embedding_dim
        self.output_size = self.num_embeddings_padded
        self.output_partition_sizes = [self.num_embeddings_per_partition]
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method.create_weights(self, embedding_dim, self.output_partition_sizes,
                                         embedding_dim, self.num_embeddings_padded,
                                         params_dtype=self.params_dtype,
                                         weight_loader=self.weight_loader)

    def _select_quant_method(self, quant_config: QuantizationConfig | None,
                             quant_method: QuantizeMethodBase | None,
                             prefix: str) -> QuantizeMethodBase:
        if quant_method is None and quant_config is not None:
            quant_method = resolve_quant_method(quant_config, self, prefix)
        if quant_method is None:
            quant_method = UnquantizedEmbeddingMethod()
        if not self._is_lm_head and not method_has_implemented_embedding(type(quant_method)):
            raise NotImplementedError(
                f"The class {type(quant_method).__name__} must implement the 'embedding' method, "
                "see UnquantizedEmbeddingMethod.")
        return quant_method

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's original-vocab rows to the top of `param`; zero the padding rows."""
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            if loaded_weight.dim() == 0:
                loaded_weight = loaded_weight.reshape(1)
            assert param.shape == loaded_weight.shape, (
                f"Attempted to load weight ({loaded_weight.shape}) into parameter ({param.shape})")
            param.data.copy_(loaded_weight)
            return
        assert loaded_weight.shape[output_dim] == self.org_vocab_size, (
            f"{type(self).__name__} expects {self.org_vocab_size} rows in the checkpoint, "
            f"got {loaded_weight.shape[output_dim]}")
        start = self.shard_indices.org_vocab_start_index
        rows = self.shard_indices.org_vocab_end_index - start
        loaded_weight = loaded_weight.narrow(output_dim, start, rows)
        param.data.narrow(output_dim, 0, rows).copy_(loaded_weight)
        param.data.narrow(output_dim, rows, param.shape[output_dim] - rows).fill_(0)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.embedding(self, input_.long())  # [T, H]
        masked_input, input_mask = get_masked_input_and_mask(input_, self.shard_indices)
        output = self.quant_method.embedding(self, masked_input.long())
        output = output.masked_fill(input_mask.unsqueeze(-1), 0)
        if self.reduce_results:
            output = self.tp_group.all_reduce(output)
        return output

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings_per_partition}, "
                f"embedding_dim={self.embedding_dim}, org_vocab_size={self.org_vocab_size}, "
                f"num_embeddings_padded={self.num_embeddings_padded}, tp_size={self.tp_size}")


@PluggableLayer.register("parallel_lm_head")
class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; its weight is used by LogitsProcessor, never by calling the module."""

    _is_lm_head = True

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, org_num_embeddings: int | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 disable_tp: bool = False, quant_method: QuantizeMethodBase | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, org_num_embeddings,
                         padding_size, quant_config, prefix, disable_tp=disable_tp,
                         quant_method=quant_method)
        self.quant_config = quant_config
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition,
                                                 dtype=self.params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> nn.Module:
        """Share `embed_tokens.weight` (the same Parameter); returns the module to keep."""
        return self.quant_method.tie_weights(self, embed_tokens)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("LMHead's weights should be used in the sampler.")
