"""flash-linear-attention's Kimi Delta Attention ops with vLLM's signatures, as vLLM's model
files call them (bailing_moe_v3.py, the KDA layers): the chunked prefill and the recurrent
decode over varlen batches; the gate (`fused_kda_gate`) and the gated output norm are
re-exported. The rule and the gate live in `model_executor/layers/mamba/ops/kda.py`; here only
the calling convention changes:

    q / k / g [1, T, H, K], v [1, T, H, V], beta [1, T, H]; sequence i owns tokens
    cu_seqlens[i]:cu_seqlens[i+1]; states [.., H, V, K] (vLLM's layout), fp32 math.
"""

import torch

from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.layers.layernorm import RMSNormGated
from minivllm.model_executor.layers.mamba.ops.kda import kda_gate as fused_kda_gate
from minivllm.model_executor.layers.mamba.ops.kda import kda_varlen
from minivllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, scale: float | None = None,
              initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
              **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill form. initial_state [N, H, V, K] (one per sequence, already zero where a
    sequence starts; None: zeros). Returns o [1, T, H, V] in q's dtype and, when asked, the
    final states [N, H, V, K] fp32. (`safe_gate` / `lower_bound` only tune FLA's kernels: g
    comes in already bounded.)"""
    cu_seqlens = _cu_seqlens(q, cu_seqlens)
    num_seqs = cu_seqlens.numel() - 1
    states = (torch.zeros(num_seqs, q.shape[2], v.shape[-1], k.shape[-1])
              if initial_state is None else initial_state.float().clone())
    md = ShortConvAttentionMetadata(cu_seqlens, torch.arange(num_seqs),
                                    torch.ones(num_seqs, dtype=torch.bool), q.shape[1])
    out = kda_varlen(q[0], k[0], v[0], g[0], beta[0], states, md, True,
                     use_qk_l2norm=use_qk_l2norm_in_kernel, scale=scale)
    return out.to(q.dtype)[None], (states if output_final_state else None)


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, scale: float | None = None,
                        initial_state: torch.Tensor | None = None,
                        inplace_final_state: bool = True, use_qk_l2norm_in_kernel: bool = True,
                        cu_seqlens: torch.Tensor | None = None,
                        ssm_state_indices: torch.Tensor | None = None,
                        **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode form over a state pool: sequence i reads and (in place) writes
    initial_state[ssm_state_indices[i]] ([slots, H, V, K]). Returns o [1, T, H, V] and the
    pool."""
    if initial_state is None or not inplace_final_state:
        raise NotImplementedError("minivllm's fused_recurrent_kda updates a state pool in place "
                                  "(initial_state given, inplace_final_state=True)")
    cu_seqlens = _cu_seqlens(q, cu_seqlens)
    num_seqs = cu_seqlens.numel() - 1
    slots = (torch.arange(num_seqs) if ssm_state_indices is None
             else ssm_state_indices.reshape(num_seqs, -1)[:, 0].long())
    md = ShortConvAttentionMetadata(cu_seqlens, slots, torch.ones(num_seqs, dtype=torch.bool),
                                    q.shape[1])
    out = kda_varlen(q[0], k[0], v[0], g[0], beta[0], initial_state, md, True,
                     use_qk_l2norm=use_qk_l2norm_in_kernel, scale=scale)
    return out.to(q.dtype)[None], initial_state


def fused_recurrent_kda_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            g: torch.Tensor, beta: torch.Tensor, scale: float,
                            initial_state: torch.Tensor, inplace_final_state: bool = True,
                            cu_seqlens: torch.Tensor | None = None,
                            ssm_state_indices: torch.Tensor | None = None,
                            num_accepted_tokens: torch.Tensor | None = None,
                            use_qk_l2norm_in_kernel: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's speculative-decoding entry; without draft tokens it is the decode form."""
    if num_accepted_tokens is not None:
        raise NotImplementedError("KDA with speculative decoding (num_accepted_tokens) is not "
                                  "supported in minivllm; run without a speculative config")
    return fused_recurrent_kda(q, k, v, g, beta, scale, initial_state, inplace_final_state,
                               use_qk_l2norm_in_kernel, cu_seqlens, ssm_state_indices)


@CustomOp.register("fused_rms_norm_gated")
class FusedRMSNormGated(RMSNormGated):
    """FLA's constructor over minivllm's `RMSNormGated`, norm first: rms_norm(x) * w * act(g)
    (KDA's output norm; g broadcasts against x, vLLM passes [T, h, d] with [1, T, h, d])."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if not elementwise_affine:
            raise NotImplementedError("FusedRMSNormGated without a weight is not supported in "
                                      "minivllm")
        super().__init__(hidden_size, eps=eps, norm_before_gate=True, device=device,
                         dtype=dtype, activation=activation)


def _cu_seqlens(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """int64 sequence boundaries; without cu_seqlens the batch rows are the sequences."""
    if cu_seqlens is None:
        if q.shape[0] != 1:
            raise ValueError("minivllm's KDA ops take one flattened varlen batch [1, T, ...] "
                             "with cu_seqlens")
        return torch.tensor([0, q.shape[1]])
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1, got {q.shape[0]}")
    return cu_seqlens.long()


__all__ = ["FusedRMSNormGated", "chunk_kda", "fused_kda_gate", "fused_recurrent_kda",
           "fused_recurrent_kda_fwd"]
