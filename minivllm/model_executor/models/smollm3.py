"""SmolLM3: Llama (GQA, usually tied embeddings) whose attention skips RoPE on some layers.

`config.no_rope_layers[i]` is a per-layer flag that reads "layer i USES RoPE" (1) or is
position-free (0, NoPE), despite its name. Configs that omit it derive it from
`no_rope_layer_interval` (n): every n-th layer (i + 1 divisible by n) is NoPE, the rest rotate.
Sliding-window layers come from `layer_types`, which Llama's attention already reads.
"""

from torch import nn

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.quantization import QuantizationConfig

from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def smollm3_uses_rope(config, layer_idx: int) -> bool:
    """Whether layer `layer_idx` rotates q / k (transformers' SmolLM3Config rule)."""
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:                       # transformers fills this in; raw dicts may not
        interval = getattr(config, "no_rope_layer_interval", 4)
        return (layer_idx + 1) % interval != 0
    return bool(flags[layer_idx])


class SmolLM3Attention(LlamaAttention):
    """Llama attention; `rotary_emb` is None on NoPE layers, which the base forward skips."""

    def _init_rotary_emb(self, config, quant_config: QuantizationConfig | None) -> None:
        # NOTE: LlamaAttention sets `self.layer_idx` before it calls this hook.
        if smollm3_uses_rope(config, self.layer_idx):
            super()._init_rotary_emb(config, quant_config)
        else:
            self.rotary_emb = None


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None,
                 attn_layer_type: type[nn.Module] = SmolLM3Attention) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config,
                         attn_layer_type=attn_layer_type)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama's model and LM head (tied when `tie_word_embeddings`), SmolLM3's layers."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = SmolLM3DecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
