"""PhiMoE (Phi-3.5-MoE): Mixtral's layout with LayerNorm blocks, biased attention, LongRoPE,
sparsemixer top-2 routing and an LM head with a bias.

The checkpoint's `block_sparse_moe` is loaded as each layer's `mlp` (Mixtral's mapper renames it);
q/k/v are stacked into `qkv_proj` as Llama's. LongRoPE (`rope_type: longrope` with explicit
`short_mscale` / `long_mscale`) comes from `get_rope` through Llama's attention, with one
short-or-long choice per engine (its `max_model_len` against `original_max_position_embeddings`).
"""

from functools import partial
from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.distributed import get_pp_group
from minivllm.model_executor.layers.layernorm import LayerNorm
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from .mixtral import MixtralDecoderLayer, MixtralForCausalLM, MixtralModel
from .qwen2_moe import SparseMoeBlock
from .utils import maybe_prefix


def sparsemixer_routing(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                        renormalize: bool, jitter_eps: float = 0.01
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparsemixer's inference routing (arXiv 2409.12136): two experts picked one after the
    other, each weighted by a softmax over only the experts whose logit lies within a relative
    distance `2 * jitter_eps` of the pick's. Deterministic at inference (training samples).

    gating_output [T, E] -> (weights [T, 2], expert ids [T, 2]); the weights do not sum to 1 and
    are not renormalised (the FusedMoE layer is built with renormalize=False).
    """
    if topk != 2 or renormalize:
        raise ValueError(f"sparsemixer routes to exactly 2 experts without renormalisation; got "
                         f"topk={topk}, renormalize={renormalize}")
    first_weight, first_id = _sparsemixer_pick(gating_output, gating_output, jitter_eps)
    # The second pick runs over the logits with the first expert removed.
    rest = gating_output.scatter(-1, first_id, float("-inf"))
    second_weight, second_id = _sparsemixer_pick(gating_output, rest, jitter_eps)
    return torch.cat([first_weight, second_weight], -1), torch.cat([first_id, second_id], -1)


def _sparsemixer_pick(logits: torch.Tensor, candidates: torch.Tensor, jitter_eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """One pick: the best of `candidates` [T, E] (`logits` with earlier picks at -inf) and its
    weight, each [T, 1]. The relative gap `(best - logit) / max(|logit|, best)` is measured on
    the unmasked logits; experts beyond `2 * jitter_eps` leave the softmax."""
    best, best_id = candidates.max(dim=-1, keepdim=True)                  # [T, 1]
    gap = (best - logits) / logits.abs().clamp(min=best)                  # [T, E]
    gates = candidates.masked_fill(gap > 2 * jitter_eps, float("-inf")).softmax(dim=-1)
    return gates.gather(-1, best_id), best_id


class PhiMoEDecoderLayer(MixtralDecoderLayer):
    """Mixtral's block (Llama attention, a sparse block on every layer) with LayerNorms that carry
    a bias, attention biases from `attention_bias` and sparsemixer routing."""


    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config: Any = None,
                 attn_layer_type: type[nn.Module] | None = None) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)
        config = config or vllm_config.model_config.hf_config
        # NOTE: PhiMoE's configs name the LayerNorm epsilon `rms_norm_eps`.
        self.input_layernorm = LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_moe(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        if config.num_experts_per_tok != 2:
            raise ValueError(f"PhiMoE's sparsemixer routing picks exactly 2 experts; "
                             f"num_experts_per_tok={config.num_experts_per_tok}")
        # transformers reads the mask threshold from router_jitter_noise (vLLM fixes 0.01, the
        # released value).
        routing = partial(sparsemixer_routing,
                          jitter_eps=getattr(config, "router_jitter_noise", 0.01))
        return SparseMoeBlock(config, config.num_local_experts, config.intermediate_size, False,
                              quant_config, prefix, custom_routing_function=routing)


class PhiMoEModel(MixtralModel):
    """Mixtral's model body with PhiMoE layers and a final LayerNorm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = PhiMoEDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        config = vllm_config.model_config.hf_config
        if get_pp_group().is_last_rank:
            self.norm = LayerNorm(config.hidden_size, eps=config.rms_norm_eps)


class PhiMoEForCausalLM(MixtralForCausalLM):
    """PhiMoE with an LM head (biased when `lm_head_bias`); LoRA, PP as Llama."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    model_cls = PhiMoEModel
    layer_cls = PhiMoEDecoderLayer
    hf_to_vllm_mapper = PhiMoEModel.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        if get_pp_group().is_last_rank and getattr(config, "lm_head_bias", False):
            if config.tie_word_embeddings:
                raise ValueError("PhiMoE with lm_head_bias needs an untied LM head "
                                 "(tie_word_embeddings=False)")
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=True,
                                          quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        # [T, H] -> [T, V]; the head's bias (this rank's vocab shard) is added before the gather.
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)

    def compute_logits_local(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias,
                                     skip_gather=True)

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor.get_top_tokens(self.lm_head, hidden_states,
                                                    self.lm_head.bias)


__all__ = ["PhiMoEDecoderLayer", "PhiMoEForCausalLM", "PhiMoEModel", "sparsemixer_routing"]
