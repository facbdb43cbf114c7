"""IBM Granite (3.x, and the SWA variant): Llama with four scalar multipliers from the config.

`embedding_multiplier` scales the input embeddings, `attention_multiplier` replaces the
`head_dim ** -0.5` attention scale, `residual_multiplier` scales each block's output before it
joins the residual stream, and the logits are divided by `logits_scaling`. Granite SWA
(`GraniteSWAForCausalLM`) adds sliding-window layers, a learned sink per head and per-layer
RoPE bases, position-free where the base is 0 (`granite_layer_attn_params`).
"""

import torch
from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import VllmConfig
from minivllm.distributed import get_pp_group
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope
from minivllm.sequence import IntermediateTensors

from .llama import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
                    input_norm)


def granite_layer_attn_params(config, layer_idx: int) -> tuple[int | None, float, bool]:
    """(sliding window or None, RoPE theta (0 = no RoPE), attention sinks?) of one layer, as
    vLLM 0.33's Granite-MoE file reads them: plain Granite configs give (None, the global theta,
    False); `layer_types` marks sliding layers and implies sinks unless `attention_sinks` says
    otherwise; `layer_rope_theta` gives per-layer thetas."""
    layer_types = getattr(config, "layer_types", None)
    sliding = layer_types is not None and layer_types[layer_idx] == "sliding_attention"
    thetas = getattr(config, "layer_rope_theta", None)
    theta = thetas[layer_idx] if thetas is not None else config.rope_parameters["rope_theta"]
    return (config.sliding_window if sliding else None, theta,
            bool(getattr(config, "attention_sinks", layer_types is not None)))


class GraniteAttention(LlamaAttention):
    """Llama attention scaled by `attention_multiplier`; Granite SWA checkpoints add per-layer
    sliding windows (`layer_types`, read by the base), sinks and RoPE bases (0: no RoPE)."""

    def _init_rotary_emb(self, config, quant_config: QuantizationConfig | None) -> None:
        _, theta, _ = granite_layer_attn_params(config, self.layer_idx)
        if not theta:
            self.rotary_emb = None
        else:
            self.rotary_emb = get_rope(
                self.head_dim, max_position=self.max_position_embeddings,
                rope_parameters={**config.rope_parameters, "rope_theta": theta},
                is_neox_style=True)
        # NOTE: LlamaAttention calls this hook before it builds `self.attn`, which takes
        # `self.scaling` as its softmax scale.
        self.scaling = config.attention_multiplier

    def _make_sinks(self, config, layer_idx: int) -> nn.Parameter | None:
        _, _, has_sink = granite_layer_attn_params(config, layer_idx)
        return self._register_sinks() if has_sink else None


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's block with `residual + multiplier * block(x)` for attention and MLP."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None,
                 attn_layer_type: type[nn.Module] = GraniteAttention) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)
        config = config or vllm_config.model_config.hf_config
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The block outputs leave scaled; the next fused add + norm (or the final norm) adds
        # them to the residual, which gives transformers' `residual + m * block(x)`.
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(
            hidden_states * self.residual_multiplier, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states * self.residual_multiplier, residual


@support_torch_compile(dynamic_arg_dims={"input_ids": {0: "b"}, "positions": {0: "b"},
                                         "intermediate_tensors": {0: "b"},
                                         "inputs_embeds": {0: "b"}})
class GraniteModel(LlamaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = GraniteDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None,
                inputs_embeds: torch.Tensor | None = None, **extra_layer_kwargs
                ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        if get_pp_group().is_first_rank:
            # Given embeddings are scaled too (vLLM's rule); embed_input_ids stays unscaled.
            if inputs_embeds is None:
                inputs_embeds = self.embed_input_ids(input_ids)
            inputs_embeds = inputs_embeds * self.config.embedding_multiplier   # [T, H]
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds,
                               **extra_layer_kwargs)


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = GraniteDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        if get_pp_group().is_last_rank:
            config = vllm_config.model_config.hf_config
            self.logits_processor = LogitsProcessor(config.vocab_size,
                                                    scale=1.0 / config.logits_scaling)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = GraniteDecoderLayer) -> nn.Module:
        return GraniteModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
