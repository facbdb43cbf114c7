"""IBM Granite MoE (Granite 3.0 / 3.1 MoE, PowerMoE) and Granite MoE Shared: Granite's four
multipliers (`granite.py`) on blocks whose MLP is a sparse MoE block.

Every layer routes each token to `num_experts_per_tok` of `num_local_experts` experts (softmax
over the top-k router logits, which equals a softmax over all of them renormalised over the
top-k). Checkpoints hold all experts of a layer in two fused tensors:
`block_sparse_moe.input_linear.weight [E, 2I, H]` (each expert's gate rows, then its up rows)
and `block_sparse_moe.output_linear.weight [E, H, I]`, which FusedMoE loads as its stacked
`gate_up_proj` / `down_proj`; the router is `block_sparse_moe.router.layer.weight [E, H]`.
Granite MoE Shared adds a dense SwiGLU `shared_mlp` (`shared_intermediate_size`) beside the
experts: `mlp(x) = moe(x) + shared_mlp(x)`. Granite MoE SWA checkpoints (vLLM serves them with
the shared class) add sliding-window layers, sinks and per-layer RoPE bases, which Granite's
attention reads from the config (`granite_layer_attn_params`).
"""

from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.activation import SiluAndMul
from minivllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from minivllm.model_executor.layers.quantization import QuantizationConfig

from .granite import GraniteAttention, GraniteDecoderLayer, GraniteForCausalLM, GraniteModel
from .llama import LlamaModel, input_norm
from .qwen2_moe import MoeForCausalLM, SparseMoeBlock
from .utils import WeightsMapper

# Checkpoint names -> module names. The stacked expert tensors keep one name for all experts;
# FusedMoE's own loader splits them per expert (and per TP rank). Newer exports name the router
# `router.weight`; the suffix rule maps that one.
GRANITE_MOE_MAPPER = WeightsMapper(
    orig_to_new_substr={
        ".block_sparse_moe.input_linear.": ".block_sparse_moe.experts.gate_up_proj.",
        ".block_sparse_moe.output_linear.": ".block_sparse_moe.experts.down_proj.",
        ".block_sparse_moe.router.layer.": ".block_sparse_moe.gate."},
    orig_to_new_suffix={".block_sparse_moe.router.weight": ".block_sparse_moe.gate.weight"},
) | LlamaModel.hf_to_vllm_mapper


class GraniteSparseMoeBlock(SparseMoeBlock):
    """Router (`gate`, replicated [E, H]) -> FusedMoE (`experts`): hidden [T, H] -> [T, H],
    all-reduced over TP. Softmax top-k, always renormalised.

    NOTE: vLLM calls its block `GraniteMoeMoE`, with another constructor and expert layout.
    vLLM's granitemoehybrid.py imports that name from `.granitemoe`; loaded as a model file it
    must keep finding vLLM's own class (`check_model/vllm_file.py` takes minivllm's module
    wherever it defines every imported name), so this one is named differently."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, config.num_local_experts, config.intermediate_size, True,
                         quant_config, prefix)


class GraniteMoeSharedMLP(nn.Module):
    """The dense expert every token also runs: `input_linear` [2 I_s, H] (gate rows, then up
    rows; one checkpoint tensor split into the merged layer's two shards) -> SiLU(gate) * up ->
    `output_linear` [H, I_s] (all-reduced over TP)."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"{prefix}: unsupported activation {config.hidden_act!r}; "
                             "Granite's shared MLP supports only 'silu'")
        size = config.shared_intermediate_size
        self.input_linear = MergedColumnParallelLinear(
            config.hidden_size, [size] * 2, bias=False, quant_config=quant_config,
            prefix=f"{prefix}.input_linear")
        self.output_linear = RowParallelLinear(size, config.hidden_size, bias=False,
                                               quant_config=quant_config,
                                               prefix=f"{prefix}.output_linear")
        self.act_fn = SiluAndMul()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.input_linear(hidden_states)            # [T, 2 I_s / tp]
        out, _ = self.output_linear(self.act_fn(gate_up))        # [T, H]
        return out


def make_shared_mlp(config: Any, quant_config: QuantizationConfig | None,
                    prefix: str) -> GraniteMoeSharedMLP | None:
    """The layer's `shared_mlp`, or None where the config has none (plain Granite MoE, or a
    `shared_intermediate_size` of 0)."""
    if not getattr(config, "shared_intermediate_size", 0):
        return None
    return GraniteMoeSharedMLP(config, quant_config, prefix=f"{prefix}.shared_mlp")


def granite_moe_ffn(block_sparse_moe: nn.Module | None, shared_mlp: nn.Module | None,
                    hidden_states: torch.Tensor) -> torch.Tensor:
    """The feed-forward part of a Granite MoE block: routed experts plus the shared MLP, each
    where the layer has one. hidden [T, H] -> [T, H]."""
    out = None
    if block_sparse_moe is not None:
        out = block_sparse_moe(hidden_states)
    if shared_mlp is not None:
        shared = shared_mlp(hidden_states)
        out = shared if out is None else out + shared
    if out is None:                  # neither (a config with no experts and no shared MLP)
        return torch.zeros_like(hidden_states)
    return out


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    """Granite's attention block, then `block_sparse_moe` (+ `shared_mlp`), each branch's output
    scaled by `residual_multiplier` before it joins the residual stream.

    NOTE: the base builds a dense `mlp` first; it is dropped before any weight is written."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config: Any = None,
                 attn_layer_type: type[nn.Module] = GraniteAttention) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)
        config = config or vllm_config.model_config.hf_config
        quant_config = self.get_quant_config(vllm_config)
        del self.mlp
        self.block_sparse_moe = GraniteSparseMoeBlock(config, quant_config,
                                              prefix=f"{prefix}.block_sparse_moe")
        self.shared_mlp = make_shared_mlp(config, quant_config, prefix)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(
            hidden_states * self.residual_multiplier, residual)
        hidden_states = granite_moe_ffn(self.block_sparse_moe, self.shared_mlp, hidden_states)
        return hidden_states * self.residual_multiplier, residual


class GraniteMoeModel(GraniteModel):
    """Granite's model body (embedding multiplier) on the MoE blocks."""

    hf_to_vllm_mapper = GRANITE_MOE_MAPPER

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = GraniteMoeDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite MoE with its LM head (logits divided by `logits_scaling`); LoRA, PP, EAGLE-3
    hooks and quantization as Llama. `get_expert_mapping` as vLLM."""

    # input_linear: one checkpoint tensor fills both shards of the shared MLP's merged layer.
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "input_linear": ["input_linear"]}
    hf_to_vllm_mapper = GRANITE_MOE_MAPPER
    get_expert_mapping = MoeForCausalLM.get_expert_mapping

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = GraniteMoeDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = GraniteMoeDecoderLayer) -> nn.Module:
        return GraniteMoeModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE Shared (and Granite MoE SWA): every block adds the dense `shared_mlp` to the
    routed experts (built from `shared_intermediate_size` by the same layer class)."""


__all__ = ["GRANITE_MOE_MAPPER", "GraniteMoeDecoderLayer", "GraniteMoeForCausalLM",
           "GraniteMoeModel", "GraniteMoeSharedForCausalLM", "GraniteMoeSharedMLP",
           "GraniteSparseMoeBlock", "granite_moe_ffn", "make_shared_mlp"]
