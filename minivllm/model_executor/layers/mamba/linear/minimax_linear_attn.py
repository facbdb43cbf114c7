"""MiniMax-Text-01's lightning-attention layer and vLLM's helpers around it
(`minimax_linear_attn.py`), which other linear-attention files import.

    q, k, v = silu(qkv_proj(h))                      fp32, [T, heads/tp, 3 d] per head
    o = lightning_attention(q, k, v)                 per-head decay slopes, `linear/base.py`
    out = out_proj(rms_norm_tp(o) * sigmoid(output_gate(h)))

vLLM's helpers take its metadata's batch order (decodes first, then prefills) and loop over
the prefills calling a per-sequence kernel; here they keep their names and arguments but run
the varlen op (`layers/lightning_attn.py`) once over all the rows, vectorised over sequences.
"""

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from minivllm.config import VllmConfig
from minivllm.model_executor.layers.lightning_attn import (lightning_attention,
                                                           linear_attention_varlen,
                                                           linear_decode_forward_triton)
from minivllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from minivllm.model_executor.layers.mamba.linear.base import (LinearAttention,
                                                              build_slope_tensor)
from minivllm.model_executor.layers.minimax_rms_norm import MiniMaxText01RMSNormTP
from minivllm.v1.attention.backends.linear_attn import (LinearAttentionBackend,
                                                         LinearAttentionMetadata)


def clear_linear_attention_cache_for_new_sequences(
        kv_cache: torch.Tensor, state_indices_tensor: torch.Tensor,
        attn_metadata: LinearAttentionMetadata) -> None:
    """Zeroes the state slots [slots, h, d, e] of the sequences that start in this step (no
    computed token: seq_lens equals the query length), all at once."""
    qsl = attn_metadata.query_start_loc
    starts = attn_metadata.seq_lens == (qsl[1:] - qsl[:-1])             # [B]
    kv_cache[state_indices_tensor[starts].long()] = 0


def linear_attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            kv_cache: torch.Tensor, slope_rate: torch.Tensor,
                            state_indices_tensor: torch.Tensor, q_start: int = 0,
                            q_end: int | None = None, slot_start: int = 0,
                            slot_end: int | None = None, block_size: int = 32) -> torch.Tensor:
    """One recurrent step for the decode rows q[q_start:q_end] ([n, h, d] each) with the
    slots state_indices_tensor[slot_start:slot_end]; states updated in place.
    Returns [n, h * d]."""
    q, k, v = (x[q_start:q_end].unsqueeze(2) for x in (q, k, v))      # [n, h, 1, d]
    return linear_decode_forward_triton(q, k, v, kv_cache, slope_rate,
                                        state_indices_tensor[slot_start:slot_end], block_size)


def linear_attention_prefill_and_mix(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
        state_indices_tensor: torch.Tensor, attn_metadata: LinearAttentionMetadata,
        slope_rate: torch.Tensor, block_size: int,
        decode_fn: Callable[..., torch.Tensor] | None = None,
        prefix_fn: Callable[..., torch.Tensor] | None = None,
        layer_idx: int | None = None) -> torch.Tensor:
    """Every row of the step, decodes and prefills (chunks continue their slot's state,
    new sequences start from zero): q / k / v [T, h, d] -> [T, h * d] fp32, states updated in
    place. decode_fn / prefix_fn (vLLM's per-kind kernels) are not needed: one varlen run
    covers both kinds."""
    md = dataclasses.replace(attn_metadata, state_indices_tensor=state_indices_tensor.long())
    out = linear_attention_varlen(q, k, v, slope_rate, kv_cache, md, write_state=True)
    return out.flatten(1)


class MiniMaxText01LinearKernel:
    @staticmethod
    def jit_linear_forward_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  kv_caches: torch.Tensor, slope_rate: torch.Tensor,
                                  block_size: int, layer_idx: int | None = None,
                                  **kwargs: object) -> torch.Tensor:
        """One sequence's prefill: q / k / v [h, n, d] (or [1, h, n, d]) continuing the state
        kv_caches [h, d, e], which is updated in place. Returns [n, h * e]."""
        if q.dim() == 3:
            q, k, v = q[None], k[None], v[None]
        if q.shape[0] != 1:
            raise ValueError(f"one sequence at a time: batch {q.shape[0]}")
        out, state = lightning_attention(q, k, v, slope_rate.float().flatten(), block_size,
                                         kv_history=kv_caches[None])
        kv_caches.copy_(state[0])
        return out[0].transpose(0, 1).flatten(1)                        # [n, h * e]


class MiniMaxText01LinearAttention(LinearAttention):
    """hidden [T, hidden_size] -> output [T, hidden_size], written into `output`."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig,
                 prefix: str = "linear_attn") -> None:
        super().__init__(config, vllm_config, prefix)
        self.qkv_size = self.num_heads * self.head_dim
        self.tp_hidden = self.head_dim * self.tp_heads
        quant = self.quant_config
        self.qkv_proj = ColumnParallelLinear(self.hidden_size, self.hidden_inner_size * 3,
                                             bias=False, quant_config=quant,
                                             prefix=f"{prefix}.qkv_proj")
        self.output_gate = ColumnParallelLinear(self.hidden_size, self.hidden_inner_size,
                                                bias=False, quant_config=quant,
                                                prefix=f"{prefix}.output_gate")
        self.out_proj = RowParallelLinear(self.hidden_inner_size, self.hidden_size, bias=False,
                                          quant_config=quant, prefix=f"{prefix}.out_proj")
        self.norm = MiniMaxText01RMSNormTP(self.hidden_inner_size, eps=1e-5)
        self.init_slopes()
        self.register_states(vllm_config)

    _build_slope_tensor = staticmethod(build_slope_tensor)

    def get_attn_backend(self) -> type[LinearAttentionBackend]:
        return LinearAttentionBackend

    def forward(self, hidden_states: torch.Tensor, output: torch.Tensor,
                positions: torch.Tensor) -> None:
        output[:hidden_states.shape[0]] = self._forward(hidden_states)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv, _ = self.qkv_proj(hidden_states)
        # [T, heads/tp, 3 d]: each head's q | k | v side by side (MiniMax's packing).
        qkv = F.silu(qkv.float()).view(num_tokens, self.tp_heads, -1)
        q, k, v = qkv.split([self.head_dim] * 3, dim=-1)
        hidden = self.norm(self.linear_attention(q, k, v))               # [T, h/tp * d]
        gate, _ = self.output_gate(hidden_states)
        hidden = (torch.sigmoid(gate) * hidden).to(hidden_states.dtype)
        out, _ = self.out_proj(hidden)
        return out
