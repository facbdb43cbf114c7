"""ERNIE 4.5 (dense, e.g. ERNIE-4.5-0.3B): Llama's pre-norm stack with two differences.

RoPE rotates interleaved pairs `(x[2i], x[2i+1])` over the whole head (GPT-J style, not
Llama's two halves), and one config flag, `use_bias`, puts a bias on every projection: q / k / v,
o_proj and the MLP's gate / up / down.
"""

from typing import TYPE_CHECKING, Any

from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.quantization import QuantizationConfig
from minivllm.model_executor.layers.rotary_embedding import get_rope

from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

if TYPE_CHECKING:     # annotations only: transformers is slow to import
    from transformers import Ernie4_5Config


def ernie_mlp(config: Any, intermediate_size: int, quant_config: QuantizationConfig | None,
              prefix: str, reduce_results: bool = True) -> LlamaMLP:
    """The SiLU-gated MLP with ERNIE's `use_bias` on all three projections."""
    return LlamaMLP(config.hidden_size, intermediate_size, config.hidden_act,
                    quant_config=quant_config, bias=bool(getattr(config, "use_bias", False)),
                    prefix=prefix, reduce_results=reduce_results)


class Ernie4_5Attention(LlamaAttention):
    """Llama attention with ERNIE's biases (`use_bias`: q / k / v and o_proj alike) and
    interleaved-pair RoPE."""

    def __init__(self, config: "Ernie4_5Config", *args: Any, **kwargs: Any) -> None:
        # NOTE: the Llama layer derives the biases from attention_bias / bias, which ERNIE's
        # config does not have; `use_bias` is the one switch.
        use_bias = bool(getattr(config, "use_bias", False))
        kwargs.update(bias=use_bias, bias_o_proj=use_bias)
        super().__init__(config, *args, **kwargs)

    def _init_rotary_emb(self, config: "Ernie4_5Config",
                         quant_config: QuantizationConfig | None) -> None:
        self.rotary_emb = get_rope(self.head_dim, max_position=self.max_position_embeddings,
                                   rope_parameters=getattr(config, "rope_parameters", None),
                                   is_neox_style=False)


class Ernie4_5DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with ERNIE's attention, and its MLP biased under `use_bias`."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config: Any = None,
                 attn_layer_type: type[nn.Module] = Ernie4_5Attention) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)
        config = config or vllm_config.model_config.hf_config
        if getattr(config, "use_bias", False):
            # NOTE: replaces the unbiased MLP the base built; that one's weights are never
            # written, so their (lazily allocated) pages are never touched.
            self.mlp = ernie_mlp(config, config.intermediate_size,
                                 self.get_quant_config(vllm_config), f"{prefix}.mlp")


class Ernie4_5Model(LlamaModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Ernie4_5DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """ERNIE 4.5 dense with an LM head (tied by default); LoRA, PP, EAGLE-3 and quantization
    as Llama (vLLM's file subclasses LlamaForCausalLM too)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Ernie4_5DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = Ernie4_5DecoderLayer) -> nn.Module:
        return Ernie4_5Model(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


__all__ = ["Ernie4_5Attention", "Ernie4_5DecoderLayer", "Ernie4_5ForCausalLM", "Ernie4_5Model",
           "ernie_mlp"]
