"""Mixtral: Llama attention (model-wide sliding window when the config sets one) with every MLP
a sparse MoE block: softmax top-k over `num_local_experts`, always renormalised.

The checkpoint's `block_sparse_moe` is loaded as each layer's `mlp` (the mapper renames it).
"""

from typing import Any

from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.quantization import QuantizationConfig

from .llama import LlamaAttention, LlamaModel
from .qwen2_moe import MoeDecoderLayer, MoeForCausalLM, SparseMoeBlock
from .utils import WeightsMapper


class MixtralDecoderLayer(MoeDecoderLayer):
    """Llama attention + a sparse block on every layer."""

    attn_cls = LlamaAttention
    every_layer_sparse = True

    def make_moe(self, config: Any, quant_config: QuantizationConfig | None,
                 prefix: str) -> nn.Module:
        return SparseMoeBlock(config, config.num_local_experts, config.intermediate_size,
                              True, quant_config, prefix)


class MixtralModel(LlamaModel):
    hf_to_vllm_mapper = (WeightsMapper(orig_to_new_substr={".block_sparse_moe.": ".mlp."})
                         | LlamaModel.hf_to_vllm_mapper)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = MixtralDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral with an LM head; LoRA, PP as Llama."""

    model_cls = MixtralModel
    layer_cls = MixtralDecoderLayer
    hf_to_vllm_mapper = MixtralModel.hf_to_vllm_mapper


__all__ = ["MixtralDecoderLayer", "MixtralForCausalLM", "MixtralModel"]
