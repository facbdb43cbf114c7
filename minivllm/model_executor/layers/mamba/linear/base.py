"""`LinearAttention`: what the lightning-attention layers (MiniMax-Text-01, Ling / Ring 2.5)
share: the fields read from the config and the engine, the per-head decay slopes, the one
per-sequence state and the step from q / k / v to the attention's output.

    S_t = exp(-slope_h) S_{t-1} + k_t^T v_t ;  o_t = q_t S_t          `layers/lightning_attn.py`

Each running sequence has a state slot (`worker/state_slots.py`; the forward context's
`state_metadata` says which): ssm_state [slots, heads / tp, d, d] (vLLM's layout, key dim
first), which vLLM's layers reach as `self.kv_cache[0]`.
"""

import math

import torch
from transformers import PretrainedConfig

from minivllm.config import VllmConfig
from minivllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)
from minivllm.forward_context import get_forward_context, is_forward_context_available
from minivllm.model_executor.custom_op import PluggableLayer
from minivllm.model_executor.layers.lightning_attn import linear_attention_varlen
from minivllm.model_executor.layers.mamba.mamba_utils import (MambaStateDtypeCalculator,
                                                              MambaStateShapeCalculator,
                                                              register_state_buffers)
from minivllm.model_executor.layers.mamba.ops.causal_conv1d import single_sequence_metadata
from minivllm.v1.attention.backends.linear_attn import LinearAttentionMetadataBuilder

# Tokens per chunk of the prefill form: vLLM's GPU kernels take config.block (256) tiles; on a
# CPU the [c, c] chunk products are cheapest around 64 (the result does not depend on it).
CPU_CHUNK_SIZE = 64


class LinearAttention(PluggableLayer):
    """Base of the lightning-attention layers (vLLM's constructor arguments)."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig,
                 prefix: str = "") -> None:
        super().__init__()
        self.layer_idx = layer_index(prefix)
        self.prefix = prefix
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.quant_config = vllm_config.quant_config
        self.BLOCK = getattr(config, "block", 256)
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_hidden_layers = config.num_hidden_layers
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self.hidden_inner_size = self.head_dim * self.num_heads
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        if self.num_heads % self.tp_size:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be divisible by the "
                             f"tensor parallel size ({self.tp_size})")
        self.tp_heads = self.num_heads // self.tp_size
        spec = vllm_config.speculative_config
        if spec is not None and spec.num_speculative_tokens:
            raise NotImplementedError("lightning-attention layers do not support speculative "
                                      "decoding in minivllm; run without a speculative config")

    @staticmethod
    def weight_direct_load(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """vLLM's loader for these layers' weights: the parameter's own loader (TP shards)
        where it has one, else a same-shape copy."""
        weight_loader = getattr(param, "weight_loader", None)
        if weight_loader is not None:
            weight_loader(param, loaded_weight)
            return
        if param.shape != loaded_weight.shape:
            raise ValueError(f"weight of shape {tuple(loaded_weight.shape)} does not fit a "
                             f"parameter of shape {tuple(param.shape)}")
        param.data.copy_(loaded_weight)

    @property
    def mamba_type(self) -> str:
        return "linear_attention"

    def get_state_dtype(self) -> tuple[torch.dtype]:
        return MambaStateDtypeCalculator.linear_attention_state_dtype(
            self.model_config.dtype, self.cache_config.mamba_cache_dtype)

    def get_state_shape(self) -> tuple[tuple[int, int, int]]:
        return MambaStateShapeCalculator.linear_attention_state_shape(
            num_heads=self.num_heads, tp_size=self.tp_size, head_dim=self.head_dim)

    def register_states(self, vllm_config: VllmConfig) -> None:
        (shape,), (dtype,) = self.get_state_shape(), self.get_state_dtype()
        register_state_buffers(self, vllm_config, {"ssm_state": (shape, dtype)})

    def init_slopes(self) -> None:
        """slope_rate [heads, 1, 1] (ALiBi's slopes, scaled down with depth: the first layer
        forgets fastest, the last barely) and tp_slope, this rank's heads."""
        slopes = build_slope_tensor(self.num_heads)
        scale = (1 + 1e-5 if self.num_hidden_layers <= 1 else
                 1 - self.layer_idx / (self.num_hidden_layers - 1) + 1e-5)
        self.slope_rate = slopes * scale
        self.tp_slope = self.slope_rate[self.tp_rank * self.tp_heads:
                                        (self.tp_rank + 1) * self.tp_heads].contiguous()

    @property
    def kv_cache(self) -> list[torch.Tensor]:
        """vLLM's name for the layer's state tensors: [ssm_state]."""
        return [self.ssm_state]

    def linear_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                         ) -> torch.Tensor:
        """q / k / v [T, heads/tp, d] (q already scaled) -> hidden [T, heads/tp * d] fp32;
        the sequences' states read and written in their slots (none in a dummy run, which
        has no forward context: one sequence from a zero state, nothing written)."""
        state_md = (get_forward_context().state_metadata if is_forward_context_available()
                    else None)
        write_state = state_md is not None
        md = LinearAttentionMetadataBuilder().build(
            state_md if write_state else single_sequence_metadata(q.shape[0]))
        out = linear_attention_varlen(q, k, v, self.tp_slope.to(q.device), self.ssm_state, md,
                                      write_state, chunk_size=CPU_CHUNK_SIZE)
        return out.flatten(1)


def build_slope_tensor(n_attention_heads: int) -> torch.Tensor:
    """ALiBi's head slopes [n, 1, 1] fp32: a geometric series from 2^(-8/n) for a power of two;
    otherwise the nearest lower power's series plus every other slope of the next one's."""
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    def slopes(n: int) -> list[float]:
        if math.log2(n).is_integer():
            return power_of_2(n)
        lower = 2 ** math.floor(math.log2(n))
        return power_of_2(lower) + slopes(2 * lower)[0::2][:n - lower]
    return torch.tensor(slopes(n_attention_heads), dtype=torch.float32).view(-1, 1, 1)


def layer_index(prefix: str) -> int:
    """The layer number in a dotted name (`model.layers.3.self_attn` -> 3). Layers do not
    import the models package (imports flow one way), hence not its `extract_layer_index`."""
    numbers = [int(part) for part in prefix.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"layer prefix {prefix!r} must hold exactly one layer number")
    return numbers[0]
