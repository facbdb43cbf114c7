"""gpt-oss: Llama-style pre-norm blocks with biased q/k/v/o projections, attention sinks (one
learned logit per head in every softmax denominator), sliding windows on alternate layers
(`layer_types`), YaRN RoPE, and a MoE block on every layer: a biased router, softmax over the
top-k logits, experts with biases and the clamped SwiGLU (vLLM's `swigluoai_uninterleave`:
the loader splits the interleaved gate / up columns into the gate-first layout).

Checkpoints store the experts fused: `gate_up_proj [E, H, 2I]` with gate and up interleaved
along the last dimension, `down_proj [E, I, H]`, and their biases; `GptOssExperts.load_weights`
cuts them into FusedMoE's per-expert gate / up / down shards. MXFP4 checkpoints are not supported.
"""

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.fused_moe import FusedMoE
from minivllm.model_executor.layers.fused_moe.fused_moe import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from minivllm.model_executor.layers.linear import ReplicatedLinear
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.models.auto_weights_loader import UnexpectedWeightsError

from .llama import LlamaAttention, LlamaModel
from .qwen2_moe import MoeDecoderLayer, MoeForCausalLM

# checkpoint tensor under `mlp.experts` -> (FusedMoE parameter, its shards along the last dim)
_FUSED_EXPERT_TENSORS = {"gate_up_proj": ("w13_weight", ("w1", "w3")),
                         "gate_up_proj_bias": ("w13_bias", ("w1", "w3")),
                         "down_proj": ("w2_weight", ("w2",)),
                         "down_proj_bias": ("w2_bias", ("w2",))}


class GptOssAttention(LlamaAttention):
    """Llama attention plus `sinks` [num_heads / TP], handed to the attention backend."""

    def _make_sinks(self, config: Any, layer_idx: int) -> nn.Parameter:
        return self._register_sinks()


class GptOssExperts(FusedMoE):
    """FusedMoE fed from gpt-oss's fused expert tensors (see the module docstring)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(recurse=False))
        loaded, unexpected = set(), []
        for name, tensor in weights:
            if name not in _FUSED_EXPERT_TENSORS:
                unexpected.append(name)
                continue
            param_name, shards = _FUSED_EXPERT_TENSORS[name]
            for expert in range(self.global_num_experts):
                # [H, 2I] / [2I] interleaved gate, up; [I, H] / [H] down
                for i, shard in enumerate(shards):
                    part = tensor[expert][..., i::len(shards)]
                    part = part.t() if part.dim() == 2 else part     # to [I, H] / [H, I]
                    self.weight_loader(params[param_name], part, name, shard, expert)
            loaded.add(param_name)
        if unexpected:
            raise UnexpectedWeightsError(type(self).__name__, unexpected, loaded,
                                         {"": list(params)})
        return loaded


class GptOssMoE(nn.Module):
    """Router (with bias) -> top-k softmax over the chosen logits -> biased swigluoai experts."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        for field, value in (("swiglu_alpha", SWIGLUOAI_ALPHA), ("swiglu_limit", SWIGLUOAI_LIMIT)):
            if getattr(config, field, value) != value:
                raise NotImplementedError(f"gpt-oss: config {field}={getattr(config, field)} "
                                          f"is not supported (only {value})")
        num_experts = config.num_local_experts
        self.router = ReplicatedLinear(config.hidden_size, num_experts, bias=True,
                                       quant_config=None, prefix=f"{prefix}.router")
        # Softmax over the top-k logits == top-k of the softmax, renormalised.
        self.experts = GptOssExperts(
            num_experts=num_experts, top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            reduce_results=True, renormalize=True, has_bias=True,
            activation="swigluoai_uninterleave",        # loaded gate rows first (above)
            quant_config=quant_config, prefix=f"{prefix}.experts")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits, _ = self.router(hidden_states)      # [T, E]
        return self.experts(hidden_states=hidden_states, router_logits=router_logits)


class GptOssDecoderLayer(MoeDecoderLayer):
    """gpt-oss attention (sinks, per-layer window) + the MoE block on every layer."""

    attn_cls = GptOssAttention
    every_layer_sparse = True

    def make_moe(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        return GptOssMoE(config, quant_config, prefix)


class GptOssModel(LlamaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = GptOssDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class GptOssForCausalLM(MoeForCausalLM):
    """gpt-oss with an LM head; PP as Llama."""

    model_cls = GptOssModel
    layer_cls = GptOssDecoderLayer


__all__ = ["GptOssAttention", "GptOssDecoderLayer", "GptOssExperts", "GptOssForCausalLM",
           "GptOssMoE", "GptOssModel"]
