"""Qwen2 / Qwen2.5: Llama with a q/k/v bias (never an o_proj bias) and a 1e6 default RoPE theta."""

import inspect
from typing import TYPE_CHECKING, Any

from torch import nn

from minivllm.compilation.decorators import support_torch_compile
from minivllm.config import VllmConfig
from minivllm.transformers_utils.config import set_default_rope_theta

from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

if TYPE_CHECKING:     # annotations only: transformers is slow to import
    from transformers import Qwen2Config

_QWEN_DEFAULT_ROPE_THETA = 1000000


class Qwen2MLP(LlamaMLP):
    """gate_up -> SiLU(gate) * up -> down; the same maths and names as Llama's MLP."""


class Qwen2Attention(LlamaAttention):
    """Llama attention whose q/k/v projection always has a bias and o_proj never does.

    NOTE: the bias flags the decoder layer derives from `attention_bias` are overridden here,
    because Qwen2 configs do not carry that field (the bias is part of the architecture).
    """

    def __init__(self, config: "Qwen2Config", *args: Any, bias: bool = True,
                 bias_o_proj: bool = False, **kwargs: Any) -> None:
        for field in ("dual_chunk_attention_config", "qk_norm"):
            if getattr(config, field, None):
                raise NotImplementedError(f"Qwen2 with {field}={getattr(config, field)!r} is not "
                                          f"supported; only {field}=None/False")
        super().__init__(config, *args, bias=True, bias_o_proj=False, **kwargs)


class Qwen2DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with Qwen2's attention."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "",
                 config: "Qwen2Config | None" = None,
                 attn_layer_type: type[nn.Module] = Qwen2Attention) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1,
                                         "intermediate_tensors": 0, "inputs_embeds": 0})
class Qwen2Model(LlamaModel):
    """Embedding -> Qwen2 layers -> final norm; `decoder_layer_type` is vLLM's hook name."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 decoder_layer_type: type[nn.Module] = Qwen2DecoderLayer) -> None:
        set_default_rope_theta(vllm_config.model_config.hf_config, _QWEN_DEFAULT_ROPE_THETA)
        super().__init__(vllm_config=vllm_config, prefix=prefix,
                         layer_type=_layer_factory(decoder_layer_type, vllm_config))


def _layer_factory(layer_type: type[nn.Module], vllm_config: VllmConfig) -> Any:
    """`layer_type` as LlamaModel calls it, `(vllm_config=, prefix=)`. A layer class written for
    vLLM's Qwen2Model (vLLM's qwen3.py has one) takes `(config, cache_config, quant_config,
    prefix)` instead, which is what vLLM's Qwen2Model passes."""
    if "vllm_config" in inspect.signature(layer_type).parameters:
        return layer_type
    config = vllm_config.model_config.hf_config.get_text_config()

    def build(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return layer_type(config=config, cache_config=vllm_config.cache_config,
                          quant_config=vllm_config.quant_config, prefix=prefix)
    return build


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 with an LM head (tied or not); LoRA, PP, quantization and EAGLE-3 as Llama."""

    hf_to_vllm_mapper = Qwen2Model.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = Qwen2DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "",
                    layer_type: type[nn.Module] = Qwen2DecoderLayer) -> nn.Module:
        return Qwen2Model(vllm_config=vllm_config, prefix=prefix, decoder_layer_type=layer_type)


__all__ = ["Qwen2Attention", "Qwen2DecoderLayer", "Qwen2ForCausalLM", "Qwen2MLP", "Qwen2Model"]
