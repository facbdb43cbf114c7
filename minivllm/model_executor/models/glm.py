"""GLM-4 v1 (`GlmForCausalLM`, glm-4-9b-*-hf): GLM-4-0414's block without the branch norms.

q/k/v bias without o_proj bias, GPT-J-style partial rotary and fused gate/up, as `glm4.py`.
"""

from torch import nn

from minivllm.config import VllmConfig

from .glm4 import Glm4DecoderLayer, Glm4ForCausalLM


class GlmDecoderLayer(Glm4DecoderLayer):
    sandwich_norms = False


class GlmForCausalLM(Glm4ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "",
                 layer_type: type[nn.Module] = GlmDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
