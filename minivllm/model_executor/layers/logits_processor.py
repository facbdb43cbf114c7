"""LogitsProcessor: LM-head projection, TP gather, vocab slicing, soft cap and scale (section 2.6)."""

import torch
import torch.nn.functional as F

from minivllm.config import get_current_vllm_config
from minivllm.distributed import tensor_model_parallel_all_gather
from minivllm.model_executor.custom_op import PluggableLayer
from minivllm.model_executor.layers.quantization import UnquantizedEmbeddingMethod
from minivllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding


@PluggableLayer.register("logits_processor")
class LogitsProcessor(PluggableLayer):
    """Turns last-layer hidden states `[N, H]` into logits `[N, org_vocab_size]`."""

    def __init__(self, vocab_size: int, org_vocab_size: int | None = None, scale: float = 1.0,
                 logits_as_input: bool = False, soft_cap: float | None = None) -> None:
        super().__init__()
        self.scale = scale
        self.vocab_size = vocab_size
        self.logits_as_input = logits_as_input  # hidden_states already are logits
        self.org_vocab_size = org_vocab_size or vocab_size
        self.soft_cap = soft_cap
        self.use_all_gather = True  # every rank gets the full logits (vLLM's default platform)
        self.head_dtype = get_current_vllm_config().model_config.head_dtype

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor,
                embedding_bias: torch.Tensor | None = None,
                skip_gather: bool = False) -> torch.Tensor | None:
        if self.logits_as_input:
            logits = hidden_states
        else:
            logits = self._get_logits(hidden_states, lm_head, embedding_bias)  # [N, V_padded/T]
            if skip_gather:
                return logits
            logits = self._gather_logits(logits, lm_head)
            if logits is not None:
                logits = logits[..., :self.org_vocab_size]  # drop the padding rows
        return self._postprocess(logits) if logits is not None else None

    def get_top_tokens(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor,
                       embedding_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy token ids `[N]`; at TP > 1 only (value, id) pairs cross ranks, not logits."""
        logits = self._postprocess(self._get_logits(hidden_states, lm_head, embedding_bias))
        token_ids = self._local_token_ids(lm_head, logits.device)  # [V_local], -1 = padding
        valid = (token_ids >= 0) & (token_ids < self.org_vocab_size)
        logits = logits.masked_fill(~valid, float("-inf"))
        values, local_index = logits.max(dim=-1, keepdim=True)  # [N, 1]
        top_ids = token_ids[local_index]
        if getattr(lm_head, "tp_size", 1) > 1:
            values = lm_head.tp_group.all_gather(values.float(), dim=-1)  # [N, T]
            top_ids = lm_head.tp_group.all_gather(top_ids, dim=-1)  # [N, T]
            # Ties go to the lowest rank, i.e. the lowest id, like argmax over full logits.
            best_rank = values.argmax(dim=-1, keepdim=True)
            top_ids = top_ids.gather(-1, best_rank)
        return top_ids.squeeze(-1)

    def get_top_k_tokens(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor,
                         k: int, embedding_bias: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) of the `k` largest logits per row, each `[N, k]`."""
        logits = self.forward(lm_head, hidden_states, embedding_bias)
        return logits.topk(k, dim=-1)

    def _get_logits(self, hidden_states: torch.Tensor, lm_head: VocabParallelEmbedding,
                    embedding_bias: torch.Tensor | None) -> torch.Tensor:
        if self.head_dtype is None or self.head_dtype == hidden_states.dtype:
            return lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)
        if not isinstance(lm_head.quant_method, UnquantizedEmbeddingMethod):
            raise ValueError(f"head_dtype {self.head_dtype} differs from the hidden states' dtype "
                             f"{hidden_states.dtype}; that is supported only for unquantized heads")
        # An LM head kept in higher precision than the model: project in head_dtype.
        bias = embedding_bias.to(self.head_dtype) if embedding_bias is not None else None
        return F.linear(hidden_states.to(self.head_dtype), lm_head.weight.to(self.head_dtype), bias)

    def _gather_logits(self, logits: torch.Tensor,
                       lm_head: VocabParallelEmbedding) -> torch.Tensor | None:
        if getattr(lm_head, "tp_size", 1) == 1:
            return logits
        group = getattr(lm_head, "tp_group", None)
        if group is None:
            return tensor_model_parallel_all_gather(logits)
        return group.all_gather(logits) if self.use_all_gather else group.gather(logits)

    def _postprocess(self, logits: torch.Tensor) -> torch.Tensor:
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    @staticmethod
    def _local_token_ids(lm_head: VocabParallelEmbedding, device: torch.device) -> torch.Tensor:
        """Global token id of each local logit column, -1 for padding columns."""
        shard = lm_head.shard_indices
        ids = torch.full((lm_head.num_embeddings_per_partition,), -1, dtype=torch.long,
                         device=device)
        n_org, n_org_padded = shard.num_org_elements, shard.num_org_elements_padded
        ids[:n_org] = torch.arange(shard.org_vocab_start_index, shard.org_vocab_end_index,
                                   device=device)
        ids[n_org_padded:n_org_padded + shard.num_added_elements] = torch.arange(
            shard.added_vocab_start_index, shard.added_vocab_end_index, device=device)
        return ids

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, org_vocab_size={self.org_vocab_size}, "
                f"scale={self.scale}, logits_as_input={self.logits_as_input}")
