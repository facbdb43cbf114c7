"""`GatedDeltaNetAttention`: what every Gated DeltaNet layer (Qwen3-Next, Qwen3.5, OLMo
hybrid) shares: the fields read from the config and the engine, its two per-sequence states,
and the step from the projected [q | k | v] to the rule's output.

    q, k, v = silu(conv1d([q | k | v]))          causal depthwise conv per sequence, from its state
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)          `ops/gated_delta_rule.py`

Each running sequence has a state slot (`worker/state_slots.py`; the forward context's
`state_metadata` says which): conv_state [slots, K - 1, (2 hk dk + hv dv) / tp] and ssm_state
[slots, hv / tp, dv, dk] (vLLM's layout). Subclasses build conv1d, the projections and the
output side; the head sizes come from the config's `linear_*` fields (`read_head_sizes`).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from minivllm.config import VllmConfig
from minivllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)
from minivllm.forward_context import get_forward_context, is_forward_context_available
from minivllm.model_executor.custom_op import PluggableLayer
from minivllm.model_executor.layers.mamba.mamba_utils import (MambaStateDtypeCalculator,
                                                              MambaStateShapeCalculator,
                                                              register_state_buffers)
from minivllm.model_executor.layers.mamba.ops.causal_conv1d import (causal_conv1d_varlen,
                                                                single_sequence_metadata)
from minivllm.model_executor.layers.mamba.ops.gated_delta_rule import gated_delta_rule_varlen


class GatedDeltaNetAttention(PluggableLayer):
    """Base of the Gated DeltaNet layers (vLLM's constructor arguments)."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig,
                 prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.layer_idx = _layer_index(prefix)
        self.hidden_size = config.hidden_size
        self.activation = config.hidden_act
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"the Gated DeltaNet conv activation (hidden_act) must be silu or "
                             f"swish, got {self.activation!r}")
        self.layer_norm_epsilon = config.rms_norm_eps
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.quant_config = vllm_config.quant_config
        self.speculative_config = vllm_config.speculative_config
        self.num_spec = (self.speculative_config.num_speculative_tokens
                         if self.speculative_config else 0)
        if self.num_spec:
            # The conv state would need K - 1 + num_spec rows, and the rule per-draft states.
            raise NotImplementedError("Gated DeltaNet layers do not support speculative "
                                      "decoding in minivllm; run without a speculative config")

    def read_head_sizes(self, config: PretrainedConfig) -> None:
        """Heads and widths from the config's `linear_*` fields, checked for TP."""
        self.num_k_heads, self.num_v_heads = (config.linear_num_key_heads,
                                              config.linear_num_value_heads)
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim          # conv channels [q | k | v]
        self.check_heads()

    def get_state_shape(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            self.tp_size, self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim,
            self.conv_kernel_size, self.num_spec)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        """(conv state, recurrent state) dtypes, from `--mamba-cache-dtype` /
        `--mamba-ssm-cache-dtype` ("auto": the model's dtype)."""
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            self.model_config.dtype, self.cache_config.mamba_cache_dtype,
            self.cache_config.mamba_ssm_cache_dtype)

    def check_heads(self) -> None:
        """Grouped heads (a key head serves hv / hk value heads) split whole over TP."""
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple "
                             f"of linear_num_key_heads ({self.num_k_heads})")
        if self.num_k_heads % self.tp_size:
            raise ValueError(f"linear_num_key_heads ({self.num_k_heads}) must be divisible by "
                             f"the tensor parallel size ({self.tp_size})")

    def register_states(self, vllm_config: VllmConfig) -> None:
        (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = (self.get_state_shape(),
                                                            self.get_state_dtype())
        register_state_buffers(self, vllm_config, {"conv_state": (conv_shape, conv_dtype),
                                                   "ssm_state": (ssm_shape, ssm_dtype)})

    def conv_and_delta_rule(self, mixed_qkv: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, rule: Callable[..., torch.Tensor] =
                            gated_delta_rule_varlen) -> torch.Tensor:
        """mixed_qkv [T, conv/tp] in the conv's [q | k | v] channel order, g / beta [T, hv/tp]
        (fp32; KDA's g [T, hv/tp, dk] with its `rule`, `ops/kda.py`) -> o [T, hv/tp, dv] in
        mixed_qkv's dtype; states read and written per sequence (none in a dummy run, which
        has no forward context)."""
        md = (get_forward_context().state_metadata if is_forward_context_available()
              else None)
        dtype, num_tokens, tp = mixed_qkv.dtype, mixed_qkv.shape[0], self.tp_size
        weight = self.conv1d.weight.view(self.conv1d.weight.shape[0], -1)    # [conv/tp, K]
        # Rounded back to the model's dtype, where transformers' conv leaves it.
        mixed_qkv = F.silu(causal_conv1d_varlen(mixed_qkv, weight, self.conv1d.bias,
                                                self.conv_state, md)).to(dtype)
        q, k, v = mixed_qkv.split([self.key_dim // tp, self.key_dim // tp,
                                   self.value_dim // tp], dim=-1)
        write_state = md is not None
        if md is None:
            md = single_sequence_metadata(num_tokens)
        out = rule(q.reshape(num_tokens, -1, self.head_k_dim),
                   k.reshape(num_tokens, -1, self.head_k_dim),
                   v.reshape(num_tokens, -1, self.head_v_dim), g, beta, self.ssm_state, md,
                   write_state, use_qk_l2norm=True)
        return out.to(dtype)


def gdn_decay(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """g = -exp(A_log) * softplus(a + dt_bias): the per-token log decay [T, heads], in fp32
    (exp(A_log) of a bf16 model could overflow)."""
    return -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())


def _layer_index(prefix: str) -> int:
    """The layer number in a dotted name (`model.layers.3.linear_attn` -> 3). Layers do not
    import the models package (imports flow one way), hence not its `extract_layer_index`."""
    numbers = [int(part) for part in prefix.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"layer prefix {prefix!r} must hold exactly one layer number")
    return numbers[0]
