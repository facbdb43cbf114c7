"""The native CPU MoE kernels (`csrc/moe_topk.cpp`, `fused_moe.cpp`, `fused_moe_gguf.cpp`): routing
and all experts, one call each.

`moe_topk` is `fused_topk`'s softmax/sigmoid routing in C; `fused_experts_bf16` runs every
selected expert of every token (pairs sorted by expert, one GEMM pair per active expert on its
contiguous rows: AMX tiles, or AVX-512 bf16 dot products on CPUs without AMX; the weighted top-k
sum fused) with no Python between experts. Both are native calls only, so a decode step whose
MoE goes through them can be recorded and replayed as a CPU graph (`compilation/cpu_graph.py`).
Each returns None when the kernels cannot take the inputs; the callers then keep the torch path
of `fused_moe.py`.
"""

import torch

from minivllm import _custom_ops as ops

_SCORING = {"softmax": 0, "sigmoid": 1}
_LOGIT_DTYPES = {torch.bfloat16: 0, torch.float32: 1}
# Without AMX the kernel's dot products stream each active expert's weights once, at vector
# speed: with AVX-512 BF16 (Zen 4) they beat the torch loop over oneDNN on decode steps and lose
# on prompts. One layer of 128 experts (2048 x 768, top-8) on the 2-core box: 2.5x at 1 token,
# 1.4x at 64, even at 128 (8 rows per expert), 0.5x at 512. Without AVX-512 BF16 (Ice Lake:
# emulated pairs, and oneDNN's bf16 GEMM at ~1/3 of its fp32 speed) the kernel wins at every
# size: 2.5x at 16 rows per expert, 2.0x at 64 (32 experts of 2048 x 768, top-8).
DOT_MAX_ROWS_PER_EXPERT = 8


def experts_supported(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """True when `fused_experts_bf16` takes these operands: bf16 CPU rows, contiguous stacked
    weights w1 [E, 2I, H] / w2 [E, H, I] with H % 32 == I % 32 == 0, and the native kernels
    (AMX tiles where usable, else AVX-512 bf16 dot products; a build without either refuses at
    the call)."""
    return (hidden_states.dtype == torch.bfloat16 and hidden_states.device.type == "cpu"
            and hidden_states.dim() == 2 and hidden_states.stride(-1) == 1
            and w1.dtype == w2.dtype == torch.bfloat16 and w1.is_contiguous()
            and w2.is_contiguous() and w1.dim() == 3 and w2.shape[0] == w1.shape[0]
            and w1.shape[2] == w2.shape[1] == hidden_states.shape[1]
            and w1.shape[1] == 2 * w2.shape[2]
            and w1.shape[2] % 32 == 0 and w2.shape[2] % 32 == 0 and ops.native_available())


def moe_topk(gating_output: torch.Tensor, topk: int, renormalize: bool, scoring_func: str,
             scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(topk_weights [T, k] fp32 (times `scale`), topk_ids [T, k] int64) from router logits
    [T, E] (bf16 or fp32, unit-stride rows); None when the kernel cannot take them."""
    lib = ops.native_lib()
    if (lib is None or gating_output.dtype not in _LOGIT_DTYPES or scoring_func not in _SCORING
            or gating_output.dim() != 2 or gating_output.stride(-1) != 1
            or gating_output.device.type != "cpu" or not 0 < topk <= gating_output.shape[1]):
        return None
    num_tokens, num_experts = gating_output.shape
    ids = torch.empty(num_tokens, topk, dtype=torch.int64)
    weights = torch.empty(num_tokens, topk, dtype=torch.float32)
    rc = lib.minivllm_moe_topk(gating_output.data_ptr(), gating_output.stride(0),
                               _LOGIT_DTYPES[gating_output.dtype], num_tokens, num_experts, topk,
                               _SCORING[scoring_func], int(renormalize), scale, ids.data_ptr(),
                               weights.data_ptr(), torch.get_num_threads())
    return (weights, ids) if rc == 0 else None


def fused_experts_bf16(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       expert_map: torch.Tensor | None = None,
                       use_amx: bool | None = None) -> torch.Tensor | None:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for bf16 x [T, H] -> [T, H]
    (SiLU-gated experts, no biases; see `experts_supported`); None when the kernel refuses.

    topk_ids: global ids, mapped by `expert_map` [E_global] (-1: another rank's expert, skipped).
    use_amx: None picks: AMX tiles where usable, else the bf16 dot kernel (AVX-512, or AVX2 on
    CPUs without AVX-512; on CPUs with AVX-512 BF16 only while the step has fewer than
    `DOT_MAX_ROWS_PER_EXPERT` rows per expert on average, else None: the torch loop over
    oneDNN); False forces the dot kernel."""
    lib = ops.native_lib()
    if lib is None:
        return None
    num_tokens, top_k = topk_ids.shape
    if use_amx is None:
        use_amx = ops._has_amx
        if (not use_amx and ops.cpu_has("avx512_bf16")
                and num_tokens * top_k >= DOT_MAX_ROWS_PER_EXPERT * w1.shape[0]):
            return None
    ids, weights, expert_map = _routing_args(topk_ids, topk_weights, expert_map)
    num_local, hidden = w1.shape[0], w1.shape[2]
    out = hidden_states.new_empty(num_tokens, hidden)
    rc = lib.minivllm_fused_experts_bf16(
        hidden_states.data_ptr(), hidden_states.stride(0), w1.data_ptr(), w2.data_ptr(),
        ids.data_ptr(), weights.data_ptr(),
        None if expert_map is None else expert_map.data_ptr(),
        num_local if expert_map is None else expert_map.shape[0], num_local, num_tokens, top_k,
        hidden, w2.shape[2], out.data_ptr(), out.stride(0), torch.get_num_threads(),
        int(use_amx))
    return out if rc == 0 else None


def _routing_args(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  expert_map: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernels' routing operands: contiguous int64 ids, fp32 weights, int64 expert map."""
    ids = topk_ids if topk_ids.dtype == torch.int64 else topk_ids.long()
    weights = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
    if expert_map is not None:
        expert_map = expert_map.to(torch.int64).contiguous()
    return ids.contiguous(), weights.contiguous(), expert_map


def fused_experts_gguf(hidden_states: torch.Tensor, w13: torch.Tensor, w13_type: int,
                       w2: torch.Tensor, w2_type: int, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None
                       ) -> torch.Tensor | None:
    """`fused_experts_bf16` for experts kept in their GGUF blocks: bf16 x [T, H] -> [T, H].

    w13 uint8 [E_local, 2I, row bytes of H] of GGML type `w13_type` (gate rows, then up rows),
    w2 uint8 [E_local, H, row bytes of I] of `w2_type`, both contiguous. Each active expert's
    rows take the int8 dot kernel (up to 4 rows) or the AMX strips, as a GGUF linear would. None
    when the kernels cannot take the operands (no native library, not bf16 x on CPU, sizes).
    """
    lib = ops.native_lib()
    if (lib is None or hidden_states.dtype != torch.bfloat16 or not hidden_states.is_cpu
            or hidden_states.dim() != 2 or hidden_states.stride(-1) != 1
            or not (w13.is_contiguous() and w2.is_contiguous())):
        return None
    num_tokens, top_k = topk_ids.shape
    ids, weights, expert_map = _routing_args(topk_ids, topk_weights, expert_map)
    num_local, inter, hidden = w13.shape[0], w13.shape[1] // 2, hidden_states.shape[1]
    out = hidden_states.new_empty(num_tokens, hidden)
    rc = lib.minivllm_fused_experts_gguf(
        hidden_states.data_ptr(), hidden_states.stride(0), w13.data_ptr(), w13_type,
        w13.stride(1), w2.data_ptr(), w2_type, w2.stride(1), ids.data_ptr(), weights.data_ptr(),
        None if expert_map is None else expert_map.data_ptr(),
        num_local if expert_map is None else expert_map.shape[0], num_local, num_tokens, top_k,
        hidden, inter, out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out if rc == 0 else None
