"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention with a sparse MoE block whose
routed experts sit beside one shared expert, scaled by a sigmoid gate.

The MoE pieces here serve the other MoE files too: `SparseMoeBlock` (router -> FusedMoE, plus
the optional gated shared expert), `MoeDecoderLayer` (Llama's block with the MLP swapped for a
sparse one where the config says so) and `EXPERT_NAMES_MAPPER`, which renames per-expert
checkpoint weights to w1 / w2 / w3 before Llama's gate/up stacking could claim them.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.fused_moe import FusedMoE
from minivllm.model_executor.layers.linear import ReplicatedLinear
from minivllm.model_executor.layers.quantization import QuantizationConfig

from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from .qwen2 import Qwen2Attention, Qwen2Model
from .utils import WeightsMapper, extract_layer_index

# Checkpoints name an expert's projections gate_proj / up_proj / down_proj (Qwen, OLMoE) or
# w1 / w3 / w2 (Mixtral); FusedMoE's mapping uses the latter.
EXPERT_NAMES_MAPPER = WeightsMapper(orig_to_new_regex={
    r"\.experts\.(\d+)\.gate_proj\.": r".experts.\1.w1.",
    r"\.experts\.(\d+)\.down_proj\.": r".experts.\1.w2.",
    r"\.experts\.(\d+)\.up_proj\.": r".experts.\1.w3."})


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated) -> FusedMoE experts, plus an optional shared expert whose
    output is scaled by `sigmoid(shared_expert_gate(x))`; hidden [T, H] -> [T, H], all-reduced.

    `num_experts`, `intermediate_size` and `renormalize` come from the family's config fields.
    """

    def __init__(self, config: Any, num_experts: int, intermediate_size: int, renormalize: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 shared_expert_intermediate_size: int = 0, **moe_kwargs: Any) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, num_experts,
                                     bias=moe_kwargs.pop("router_bias", False), quant_config=None,
                                     prefix=f"{prefix}.gate")
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_intermediate_size > 0:
            # reduce_results=False: the routed and shared partial sums are reduced once, together.
            self.shared_expert = LlamaMLP(config.hidden_size, shared_expert_intermediate_size,
                                          config.hidden_act, quant_config=quant_config,
                                          reduce_results=False, prefix=f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False,
                                                       quant_config=None,
                                                       prefix=f"{prefix}.shared_expert_gate")
        self.experts = FusedMoE(
            num_experts=num_experts, top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size, intermediate_size=intermediate_size,
            reduce_results=False, renormalize=renormalize, quant_config=quant_config,
            expert_mapping=FusedMoE.make_expert_params_mapping(None, "w1", "w2", "w3",
                                                               num_experts),
            prefix=f"{prefix}.experts", **moe_kwargs)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])                        # [T, H]
        router_logits, _ = self.gate(x)                              # [T, E]
        out = self.experts(hidden_states=x, router_logits=router_logits)   # partial [T, H]
        if self.shared_expert is not None:
            gate, _ = self.shared_expert_gate(x)                     # [T, 1]
            out = out + F.sigmoid(gate) * self.shared_expert(x)
        return self.experts.maybe_all_reduce_tensor_model_parallel(out).view(shape)


def is_sparse_layer(config: Any, layer_idx: int, num_experts: int) -> bool:
    """Qwen-MoE's rule: every `decoder_sparse_step`-th layer, except `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts > 0 and (layer_idx + 1) % step == 0)


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with `attn_cls` attention whose `mlp` is `make_moe(...)` on
    sparse layers (every layer with `every_layer_sparse`, else Qwen-MoE's rule).

    NOTE: the base builds a dense MLP first and this replaces it; its weights are never
    written, so their (lazily allocated) pages are never touched.
    """

    attn_cls: type[nn.Module] = Qwen2Attention
    every_layer_sparse = False

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config: Any = None,
                 attn_layer_type: type[nn.Module] | None = None) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type or self.attn_cls)
        config = config or vllm_config.model_config.hf_config
        if self.sparse(config, extract_layer_index(prefix)):
            self.mlp = self.make_moe(config, self.get_quant_config(vllm_config), f"{prefix}.mlp")

    def sparse(self, config: Any, layer_idx: int) -> bool:
        return self.every_layer_sparse or is_sparse_layer(config, layer_idx, config.num_experts)

    def make_moe(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        return SparseMoeBlock(config, config.num_experts, config.moe_intermediate_size,
                              config.norm_topk_prob, quant_config, prefix,
                              getattr(config, "shared_expert_intermediate_size", 0))


class Qwen2MoeDecoderLayer(MoeDecoderLayer):
    """Qwen2 attention (q/k/v bias) + the sparse block with its gated shared expert."""


class Qwen2MoeModel(Qwen2Model):
    hf_to_vllm_mapper = EXPERT_NAMES_MAPPER | Qwen2Model.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 decoder_layer_type: type[nn.Module] = Qwen2MoeDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         decoder_layer_type=decoder_layer_type)


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's causal-LM wrapper around a MoE model (`model_cls`); `get_expert_mapping` as vLLM."""

    model_cls: type[nn.Module] = Qwen2MoeModel
    layer_cls: type[nn.Module] = Qwen2MoeDecoderLayer

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=self.layer_cls)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] | None = None) -> nn.Module:
        return self.model_cls(vllm_config=vllm_config, prefix=prefix,
                              **{self._layer_arg(): layer_type or self.layer_cls})

    def _layer_arg(self) -> str:
        # Qwen2Model subclasses take vLLM's `decoder_layer_type`, Llama ones `layer_type`.
        return "decoder_layer_type" if issubclass(self.model_cls, Qwen2Model) else "layer_type"

    def get_expert_mapping(self) -> list[tuple[str, str, int, str]]:
        moe = next((m for m in self.modules() if isinstance(m, FusedMoE)), None)
        return [] if moe is None else moe.expert_mapping     # none on an all-dense PP stage


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE with an LM head; LoRA, PP as Llama."""

    hf_to_vllm_mapper = Qwen2MoeModel.hf_to_vllm_mapper


__all__ = ["EXPERT_NAMES_MAPPER", "MoeDecoderLayer", "MoeForCausalLM", "Qwen2MoeDecoderLayer",
           "Qwen2MoeForCausalLM", "Qwen2MoeModel", "SparseMoeBlock", "is_sparse_layer"]
