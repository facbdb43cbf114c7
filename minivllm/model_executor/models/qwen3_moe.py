"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3 attention (per-head QK-norm) with a sparse MoE
block of routed experts only (no shared expert), top-k renormalised per `norm_topk_prob`."""

from torch import nn

from minivllm.config import VllmConfig

from .qwen2 import Qwen2Model
from .qwen2_moe import EXPERT_NAMES_MAPPER, MoeDecoderLayer, MoeForCausalLM
from .qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    """Qwen3 attention + the sparse block (`mlp_only_layers` / `decoder_sparse_step` as Qwen2)."""

    attn_cls = Qwen3Attention


class Qwen3MoeModel(Qwen2Model):
    hf_to_vllm_mapper = EXPERT_NAMES_MAPPER | Qwen2Model.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 decoder_layer_type: type[nn.Module] = Qwen3MoeDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         decoder_layer_type=decoder_layer_type)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE with an LM head; LoRA, PP as Llama."""

    model_cls = Qwen3MoeModel
    layer_cls = Qwen3MoeDecoderLayer
    hf_to_vllm_mapper = Qwen3MoeModel.hf_to_vllm_mapper


__all__ = ["Qwen3MoeDecoderLayer", "Qwen3MoeForCausalLM", "Qwen3MoeModel"]
