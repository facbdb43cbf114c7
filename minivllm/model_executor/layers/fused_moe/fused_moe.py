"""MoE math as functions (vLLM's names): top-k routing and the expert computation.

Routing turns router logits `[T, E]` into `topk_weights [T, k]` (fp32) and `topk_ids [T, k]`
(int64, global expert ids): `fused_topk` (softmax or sigmoid scores, optional renormalisation,
optional score-correction bias that only steers the choice) and `grouped_topk` (DeepSeek-style:
experts in `num_expert_group` groups, only the best `topk_group` groups may be chosen).

`fused_experts` runs the experts: the (token, expert) pairs are sorted by expert, each active
expert multiplies its contiguous rows with one GEMM pair (gate_up, activation, down), and the
weighted rows are added back to their tokens. SiLU experts without biases in bf16 on CPU run in
one native call (`cpu_fused_moe.py`: AMX tiles; without AMX, AVX-512 bf16 dot products on
decode-sized steps); otherwise a Python loop over the active experts (never over tokens) calls
the AMX GEMMs (`csrc/gemm_amx.cpp`) up to 1024 rows per expert, or `F.linear` (oneDNN).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels.op_library import register_op
from minivllm.model_executor.layers.fused_moe.activation import (MOE_ACTIVATIONS,
                                                                 apply_activation_no_mul,
                                                                 is_gated)
from minivllm.model_executor.layers.fused_moe.cpu_fused_moe import (experts_supported,
                                                                    fused_experts_bf16)

SCORING_FUNCS = ("softmax", "sigmoid")
# vLLM 0.33's MoE activations, gated and non-gated ("*_no_mul"): see `activation.py`.
ACTIVATIONS = MOE_ACTIVATIONS
# gpt-oss's clamped SwiGLU (vLLM's "swigluoai"): alpha and limit of its reference code.
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0


def _scores(gating_output: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """fp32 scores [T, E] from router logits."""
    if scoring_func == "softmax":
        return torch.softmax(gating_output.float(), dim=-1)
    if scoring_func == "sigmoid":
        return gating_output.float().sigmoid()
    raise ValueError(f"Unsupported scoring function {scoring_func!r}; choose one of "
                     f"{', '.join(SCORING_FUNCS)}")


def _pick(scores: torch.Tensor, choice: torch.Tensor, topk: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of `choice` [T, E]; the weights are `scores` at those experts (renormalised)."""
    topk_ids = torch.topk(choice, topk, dim=-1).indices             # [T, k]
    topk_weights = scores.gather(1, topk_ids)                       # [T, k] fp32
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
               renormalize: bool, indices_type: torch.dtype | None = None,
               scoring_func: str = "softmax",
               e_score_correction_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32, topk_ids [T, k], token_expert_indices [T, k]).

    `token_expert_indices[t, j] = j * T + t`: the pair's row in a k-major layout (vLLM's third
    output). With `e_score_correction_bias` the experts are chosen by `score + bias`, weighted by
    the unbiased score.
    """
    assert hidden_states.shape[0] == gating_output.shape[0], "one row of logits per token"
    scores = _scores(gating_output, scoring_func)
    choice = scores if e_score_correction_bias is None \
        else scores + e_score_correction_bias.float()
    topk_weights, topk_ids = _pick(scores, choice, topk, renormalize)
    num_tokens = gating_output.shape[0]
    token_expert_indices = (torch.arange(topk, dtype=torch.int32)[None, :] * num_tokens
                            + torch.arange(num_tokens, dtype=torch.int32)[:, None])
    return topk_weights, topk_ids.to(indices_type or torch.int64), token_expert_indices


def grouped_topk(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                 renormalize: bool, num_expert_group: int = 0, topk_group: int = 0,
                 scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
                 e_score_correction_bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k inside the best `topk_group` of `num_expert_group` expert groups.

    A group's score is its best expert's score, or (with a correction bias, as DeepSeek-V3) the
    sum of its two best biased scores. Weights are the unbiased scores, renormalised when asked,
    then multiplied by `routed_scaling_factor`.
    """
    scores = _scores(gating_output, scoring_func)                   # [T, E]
    num_tokens, num_experts = scores.shape
    if (num_expert_group <= 0 or num_experts % num_expert_group
            or not 0 < topk_group <= num_expert_group):
        raise ValueError(f"grouped top-k needs num_expert_group dividing the {num_experts} experts "
                         f"and 0 < topk_group <= num_expert_group; got num_expert_group="
                         f"{num_expert_group}, topk_group={topk_group}")
    choice = scores if e_score_correction_bias is None \
        else scores + e_score_correction_bias.float()
    grouped = choice.view(num_tokens, num_expert_group, -1)         # [T, G, E/G]
    if e_score_correction_bias is None:
        group_scores = grouped.max(dim=-1).values                   # [T, G]
    else:
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    group_idx = torch.topk(group_scores, topk_group, dim=-1).indices     # [T, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    topk_weights, topk_ids = _pick(scores, masked, topk, renormalize)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


def gated_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Gated activation of gate_up rows [n, 2I] -> [n, I]: the gate half first, then the up
    half; for "swigluoai" the two alternate (gate0, up0, gate1, up1, ...). A non-gated
    activation ("relu2_no_mul") maps its up rows [n, I] -> [n, I] alone."""
    if activation in ACTIVATIONS and not is_gated(activation):
        return apply_activation_no_mul(h, activation)
    if activation == "swigluoai":
        gate, up = h[:, 0::2], h[:, 1::2]
    else:
        d = h.shape[-1] // 2
        gate, up = h[:, :d], h[:, d:]
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation in ("swigluoai", "swigluoai_uninterleave"):
        gate = gate.clamp(max=SWIGLUOAI_LIMIT)
        up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))
    raise ValueError(f"Unsupported MoE activation {activation!r}; choose one of "
                     f"{', '.join(ACTIVATIONS)}")


def _amx_rows(w1: torch.Tensor, w2: torch.Tensor) -> int:
    """Up to how many rows of one expert the native AMX GEMMs take (0: never).

    Measured on Qwen3-30B-A3B's expert shapes (w1 [1536, 2048], w2 [2048, 768], one thread):
    the AMX GEMM on the plain weight beats `F.linear` (experts have no oneDNN-packed copy) up to
    512 rows and beyond (w1 at 128 rows 4.3 vs 7.6 ms, at 512 29 vs 44 ms; w2 even at 512).
    """
    if w1.dtype != torch.bfloat16 or w1.device.type != "cpu":
        return 0
    supported = ops.gemm_supports_weight(w1[0]) and ops.gemm_supports_weight(w2[0])
    return ops.GEMM_PROMPT_ROWS if supported else 0


def _expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b1: torch.Tensor | None,
                b2: torch.Tensor | None, activation: str, amx_rows: int) -> torch.Tensor:
    """One expert on its rows: x [n, H], w1 [2I, H], w2 [H, I] -> [n, H]."""
    if x.shape[0] <= amx_rows and x.dtype == torch.bfloat16:
        if activation == "silu" and b1 is None and w1.shape[0] % 32 == 0:
            h = ops.gemm_silu_mul_bf16(x, w1, None)                 # [n, I]
        else:
            h = gated_activation(ops.gemm_bf16(x, w1, b1), activation)
        return ops.gemm_bf16(h, w2, b2)
    return F.linear(gated_activation(F.linear(x, w1, b1), activation), w2, b2)


def fused_experts(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, inplace: bool = False,
                  activation: str = "silu", apply_router_weight_on_input: bool = False,
                  global_num_experts: int = -1, expert_map: torch.Tensor | None = None,
                  w1_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for x [T, H] -> [T, H].

    w1 [E_local, 2I, H] (gate rows, then up rows), w2 [E_local, H, I]; `expert_map` [E_global]
    maps global ids to local rows (-1: another rank's expert, whose pairs are skipped).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"Unsupported MoE activation {activation!r}; choose one of "
                         f"{', '.join(ACTIVATIONS)}")
    if (activation == "silu" and w1_bias is None and w2_bias is None
            and not apply_router_weight_on_input and experts_supported(hidden_states, w1, w2)):
        native = fused_experts_bf16(hidden_states, w1, w2, topk_weights, topk_ids, expert_map)
        if native is not None:
            return hidden_states.copy_(native) if inplace else native
    amx_rows = _amx_rows(w1, w2)

    def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        return _expert_mlp(x, w1[expert], w2[expert],
                           None if w1_bias is None else w1_bias[expert],
                           None if w2_bias is None else w2_bias[expert], activation, amx_rows)

    out = run_experts(hidden_states, topk_weights, topk_ids, expert_map, w1.shape[0], expert_mlp,
                      apply_router_weight_on_input)
    return hidden_states.copy_(out) if inplace else out


def run_experts(hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int,
                expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],
                apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_mlp(topk_ids[t, j], x[t]) for x [T, H] -> [T, H], a
    Python loop over the active local experts (never over tokens): the (token, expert) pairs
    sorted by expert, each expert's rows [n, H] gathered and given to `expert_mlp(expert, rows)`
    -> [n, H] at once, the weighted results added back to their tokens."""
    num_tokens, top_k = topk_ids.shape
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map[ids]
    # Pairs of other ranks' experts go to a sentinel bin after the last local expert.
    ids = torch.where(ids < 0, num_local, ids).flatten()            # [T*k]
    order = torch.argsort(ids, stable=True)                         # pairs sorted by expert
    counts = torch.bincount(ids, minlength=num_local + 1).tolist()
    num_pairs = num_tokens * top_k - counts[num_local]
    order = order[:num_pairs]
    tokens = order // top_k                                         # [N] token of each pair
    weights = topk_weights.flatten()[order].to(hidden_states.dtype)[:, None]   # [N, 1]
    # One expert's rows at a time, gathered, multiplied and added back while they are in cache:
    # [N, H] gathered rows and results written whole cost ~45 ms a layer on the 2-core box for a
    # Qwen3-30B-A3B prompt of 2048 tokens (index_select, out * weights). A token's k results are
    # summed in fp32 and rounded once (as one index_add_ over many pairs does on CPU).
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    start = 0
    for expert, n in enumerate(counts[:num_local]):                 # active experts only
        if n == 0:
            continue
        rows, w = tokens[start:start + n], weights[start:start + n]
        x = hidden_states.index_select(0, rows)                     # [n, H]
        if apply_router_weight_on_input:
            x = x * w
        y = expert_mlp(expert, x)
        out.index_add_(0, rows, (y if apply_router_weight_on_input else y * w).float())
        start += n
    return out.to(hidden_states.dtype)


def fused_moe(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              gating_output: torch.Tensor, topk: int, renormalize: bool, inplace: bool = False,
              activation: str = "silu", use_grouped_topk: bool = False,
              num_expert_group: int | None = None, topk_group: int | None = None,
              scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
              e_score_correction_bias: torch.Tensor | None = None,
              global_num_experts: int = -1, expert_map: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Routing (`fused_topk` / `grouped_topk`) followed by `fused_experts`."""
    if use_grouped_topk:
        topk_weights, topk_ids = grouped_topk(
            hidden_states, gating_output, topk, renormalize, num_expert_group or 0,
            topk_group or 0, scoring_func, routed_scaling_factor, e_score_correction_bias)
    else:
        topk_weights, topk_ids, _ = fused_topk(hidden_states, gating_output, topk, renormalize,
                                               scoring_func=scoring_func,
                                               e_score_correction_bias=e_score_correction_bias)
        topk_weights = topk_weights * routed_scaling_factor
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=inplace,
                         activation=activation, global_num_experts=global_num_experts,
                         expert_map=expert_map)


def fused_experts_op(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_map: torch.Tensor | None, w1_bias: torch.Tensor | None,
                      w2_bias: torch.Tensor | None, activation: str,
                      apply_router_weight_on_input: bool) -> torch.Tensor:
    """`fused_experts` with every argument positional: the `minivllm::fused_experts` op."""
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation=activation,
                         apply_router_weight_on_input=apply_router_weight_on_input,
                         expert_map=expert_map, w1_bias=w1_bias, w2_bias=w2_bias)


def fused_experts_fake(hidden_states: torch.Tensor, *args: object) -> torch.Tensor:
    """The fake (meta) result of every expert op: a tensor shaped like the input rows."""
    return torch.empty_like(hidden_states)


# `torch.ops.minivllm.fused_experts`: compiled graphs call the expert loop opaquely (its
# per-step expert counts would otherwise break the graph).
register_op("fused_experts(Tensor hidden_states, Tensor w1, Tensor w2, Tensor topk_weights, "
            "Tensor topk_ids, Tensor? expert_map, Tensor? w1_bias, Tensor? w2_bias, "
            "str activation, bool apply_router_weight_on_input) -> Tensor",
            fused_experts_op, fused_experts_fake)
