"""EAGLE heads for Llama-family targets (vLLM's `EagleLlamaForCausalLM`, the `eagle` method).

An EAGLE head drafts the target's next token from the target's own features. At position j it
reads the target's last hidden state h_j [H] (after the final norm) and the embedding of the
token that followed, t_{j+1}: x_j = fc([embed(t_{j+1}), h_j]) [2H -> H], then its decoder
layers (the first without an input norm: fc's output enters the residual stream as it is). Its
output x + residual [H] is read by the target's LM head (no final norm), and fed back in place
of h for the next draft position. The head's attention layers keep their own paged KV cache,
named past the target's layers (`layers.{L + i}`).

The checkpoint names its tensors without `model.`; `embed_tokens` and `lm_head` are usually
absent, and the proposer then gives the head the target's (`has_own_*` say which it brought).
"""

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import VllmConfig
from minivllm.model_executor.layers.linear import ReplicatedLinear
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from minivllm.model_executor.models.llama import LlamaDecoderLayer as BaseLlamaDecoderLayer
from minivllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel as BaseLlamaModel

from .utils import (AutoWeightsLoader, get_draft_quant_config, maybe_prefix,
                    process_eagle_weight)


def eagle_fc(vllm_config: VllmConfig, in_size: int, out_size: int,
             quant_config: QuantizationConfig | None, prefix: str) -> ReplicatedLinear:
    """An EAGLE head's input projection `fc` (no bias), in the target's dtype."""
    return ReplicatedLinear(in_size, out_size, bias=False,
                            params_dtype=vllm_config.model_config.dtype,
                            quant_config=quant_config, prefix=maybe_prefix(prefix, "fc"),
                            return_bias=False)


class LlamaDecoderLayer(BaseLlamaDecoderLayer):
    """A Llama block built with the draft's quantization; the head's first one has no input
    norm (EAGLE's layer reads fc's output unnormalised)."""

    def __init__(self, vllm_config: VllmConfig, disable_input_layernorm: bool,
                 prefix: str = "", config=None) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config)
        if disable_input_layernorm:
            self.input_layernorm = nn.Identity()

    def get_quant_config(self, vllm_config: VllmConfig) -> QuantizationConfig | None:
        return get_draft_quant_config(vllm_config)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "hidden_states": 0})
class LlamaModel(nn.Module):
    """fc over [token embedding, target feature], then the head's decoder layers."""

    hf_to_vllm_mapper = BaseLlamaModel.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 start_layer_id: int = 0) -> None:
        super().__init__()
        self.config = config = vllm_config.speculative_config.draft_model_config.hf_config
        self.vocab_size = config.vocab_size
        self.quant_config = get_draft_quant_config(vllm_config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        self.layers = nn.ModuleList([
            LlamaDecoderLayer(vllm_config, i == 0, config=config,
                              prefix=maybe_prefix(prefix, f"layers.{start_layer_id + i}"))
            for i in range(config.num_hidden_layers)])
        self.fc = eagle_fc(vllm_config, 2 * config.hidden_size, config.hidden_size,
                           self.quant_config, prefix)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (t_{j+1}), positions [T] (j), hidden_states [T, H] (h_j) ->
        (the features the LM head reads, the features the next draft step reads), both [T, H]
        and equal for EAGLE-1."""
        x = self.fc(torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        out = x + residual
        return out, out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


class EagleLlamaForCausalLM(LlamaForCausalLM):
    """The head as the proposer drives it: `forward(input_ids, positions, hidden_states)` and
    the inherited `compute_logits` on an LM head the proposer shares from the target (unless
    the checkpoint has one)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)     # not Llama's body: the head builds its own parts
        self.config = config = vllm_config.speculative_config.draft_model_config.hf_config
        if getattr(config, "draft_vocab_size", None) is None:
            config.draft_vocab_size = config.vocab_size
        self.model = LlamaModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                start_layer_id=vllm_config.model_config.get_num_layers())
        self.logits_processor = LogitsProcessor(config.vocab_size,
                                                scale=getattr(config, "logit_scale", 1.0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, inputs_embeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs_embeds is not None:
            raise NotImplementedError(f"{type(self).__name__} drafts from token ids only")
        return self.model(input_ids, positions, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def under_model(item: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
            name, tensor = item
            if "lm_head" not in name:
                name = "model." + name
            process_eagle_weight(self, name)
            return name, tensor

        return AutoWeightsLoader(self).load_weights(map(under_model, weights))
