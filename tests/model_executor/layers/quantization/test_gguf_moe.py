"""GGUF MoE experts on their packed blocks (`quantization/gguf_moe.py`, the native
`fused_experts_gguf` of `csrc/fused_moe_gguf.cpp`): the one-call kernel against the dequantised fp32
experts and against the per-expert loop of packed linears, for legacy and K-quant types (mixed
between gate_up and down, as llama.cpp's Q4_K_M files mix them), decode- and prompt-sized
steps, and other ranks' experts; fp32 x (the reference precision) equal to the dequantised
experts; the loader's type and tensor-parallel errors."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from minivllm.forward_context import BatchDescriptor, ForwardContext, override_forward_context
from minivllm import _custom_ops as ops
from minivllm.model_executor.kernels import gguf_linear as gl
from minivllm.model_executor.kernels.gguf_linear import (gguf_dequantize, gguf_int8_max_rows,
                                                         gguf_matmul)
from minivllm.model_executor.layers.fused_moe.cpu_fused_moe import fused_experts_gguf
from minivllm.model_executor.layers.fused_moe.fused_moe import (fused_experts, fused_topk,
                                                                gated_activation, run_experts)
from minivllm.model_executor.layers.quantization.gguf_moe import (GGUFMoEMethod,
                                                                  gguf_fused_experts)
from tests.model_executor.kernels.test_gguf_linear import random_weight

E, H, I, K = 8, 256, 256, 2        # K-quant blocks are 256 values: H and I one block each
TYPE_PAIRS = [(T.Q8_0, T.Q8_0), (T.Q4_1, T.Q8_0), (T.Q4_K, T.Q6_K), (T.Q5_K, T.Q4_0)]


def _experts(q13: int, q2: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed w13 [E, 2I, bytes], packed w2 [E, H, bytes], and both dequantised to fp32)."""
    w13 = torch.from_numpy(np.stack([random_weight(q13, 2 * I, H, e) for e in range(E)]))
    w2 = torch.from_numpy(np.stack([random_weight(q2, H, I, 100 + e) for e in range(E)]))
    r13 = torch.stack([gguf_dequantize(w, q13, torch.float32) for w in w13])
    r2 = torch.stack([gguf_dequantize(w, q2, torch.float32) for w in w2])
    return w13, w2, r13, r2


def _tokens(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen)
    weights, ids, _ = fused_topk(x, torch.randn(num_tokens, E, generator=gen), K, True)
    return x, weights, ids


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def _packed_loop(x, w13, q13, w2, q2, weights, ids, expert_map=None):
    """The experts one by one through the packed linears (what the layer falls back to)."""
    def mlp(e, rows):
        return gguf_matmul(gated_activation(gguf_matmul(rows, w13[e], q13, None), "silu"),
                           w2[e], q2, None)
    return run_experts(x, weights, ids, expert_map, E, mlp)


@pytest.mark.requires_native
@pytest.mark.parametrize("q13,q2", TYPE_PAIRS, ids=lambda q: T(q).name)
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_native_experts_match_dequantised_and_the_packed_loop(q13, q2, num_tokens):
    """bf16 x: the int8 kernels (up to 4 rows per expert, every row count without AMX) or AMX
    strips, within the error of int8 activations plus bf16 roundings (~1%) of the exact experts,
    and within the roundings (~0.3%) of the per-expert loop of the same kernels (its linears in a
    decode step, where they take the int8 kernels without AMX too)."""
    w13, w2, r13, r2 = _experts(q13, q2)
    x, weights, ids = _tokens(num_tokens, seed=num_tokens)
    ref = fused_experts(x, r13, r2, weights, ids)
    native = fused_experts_gguf(x.bfloat16(), w13, int(q13), w2, int(q2), weights, ids)
    assert native is not None and native.dtype == torch.bfloat16
    assert _relative(native, ref) < 0.03
    with override_forward_context(ForwardContext(
            no_compile_layers={}, attn_metadata=None,
            batch_descriptor=BatchDescriptor(num_tokens, num_tokens, uniform=True))):
        loop = _packed_loop(x.bfloat16(), w13, int(q13), w2, int(q2), weights, ids)
        loop_int8_rows = gguf_int8_max_rows()
    # Without VNNI (AVX2) the loop's linears of more than 4 rows take dequantised tiles (no int8
    # step) while the native experts keep the int8 dot kernels: then the two differ by the
    # activations' int8 error too.
    most_rows = int(torch.bincount(ids.flatten()).max())
    int8_both = ops._has_amx or most_rows <= loop_int8_rows
    assert _relative(native, loop.float()) < (0.01 if int8_both else 0.02)
    # The layer's entry point takes the same native call.
    entry = gguf_fused_experts(x.bfloat16(), w13, int(q13), w2, int(q2), weights, ids, None,
                               None, None, "silu", False)
    assert torch.equal(entry, native)


@pytest.mark.requires_native
@pytest.mark.parametrize("q13,q2", [(T.Q4_1, T.Q8_0), (T.Q4_K, T.Q6_K), (T.Q5_0, T.Q5_K),
                                     (T.Q3_K, T.Q2_K)],
                         ids=lambda q: T(q).name)
@pytest.mark.parametrize("num_tokens", [1, 3, 40, 200])    # 200: whole experts per thread
def test_native_experts_in_the_x8_layout(num_tokens, q13, q2):
    """CPUs with the x8 kernels (AVX2: 8-row groups, AVX-512 VNNI: 16) rearrange experts of
    their x8 types (AVX2: Q4_0/Q4_1/Q8_0; VNNI: also Q5_0/Q5_1 and the K-quants
    Q4_K/Q5_K/Q6_K) into the x8 layout at load: the native call on those bytes (decode pieces
    through gguf_dot_rows, prompts through gguf_gemm) gives the plain layout's products up to
    the fp32 summation order (on AMX, up to the int8 rounding of x: there the file layout's
    decode pieces of 5+ rows take the bf16 strips, the x8 layout's the int8 dot)."""
    w13, w2, _, _ = _experts(q13, q2)
    x, weights, ids = _tokens(num_tokens, seed=7)
    plain = fused_experts_gguf(x.bfloat16(), w13, int(q13), w2, int(q2), weights, ids)
    if not gl.gguf_x8_rows():
        # a build without the x8 kernels (scalar) refuses the flag (the layer never sets it there, see
        # test_loader_keeps_blocks_and_slices_whole_blocks_per_rank)
        if gl._resolve() is not None and not gl._Native.x8_rows:
            flagged = int(T.Q4_1) | gl.GGUF_X8_LAYOUT
            assert fused_experts_gguf(x.bfloat16(), w13, flagged, w2, int(T.Q8_0), weights,
                                      ids) is None
        pytest.skip("experts take the x8 layout with the AVX2 or VNNI kernels only (this CPU "
                    "runs scalar ones, or MINIVLLM_GGUF_X8=0)")
    x13, x2 = w13.clone(), w2.clone()
    c13 = gl.gguf_repack_for_cpu(x13.view(-1, x13.shape[2]), int(q13))
    c2 = gl.gguf_repack_for_cpu(x2.view(-1, x2.shape[2]), int(q2))
    if not {int(q13), int(q2)} <= gl.gguf_x8_types():
        # the AVX2 kernels: only the legacy three take the layout, the rest keep the file's
        assert gl.gguf_x8_rows() == 8 and (c13, c2) == (int(q13), int(q2))
        pytest.skip(f"{T(q13).name}/{T(q2).name} experts take the x8 layout with VNNI only")
    assert c13 & c2 & gl.GGUF_X8_LAYOUT and not torch.equal(x13, w13)
    x8 = fused_experts_gguf(x.bfloat16(), x13, c13, x2, c2, weights, ids)
    bf16_pieces = gl._Native.amx and 4 < num_tokens < 200     # see the docstring
    assert x8 is not None and _relative(x8, plain.float()) < (0.02 if bf16_pieces else 2e-3)
    # the layer's fallback loop reads the same layout through gguf_linear
    loop = _packed_loop(x.bfloat16(), x13, c13, x2, c2, weights, ids)
    assert _relative(loop, plain.float()) < 0.02


@pytest.mark.requires_native
@pytest.mark.parametrize("num_tokens", [1, 40, 200])
def test_native_experts_do_not_depend_on_the_thread_count(num_tokens):
    """1 and 40 tokens (a few rows per expert: x and h quantized once, pieces of weight rows
    split over the threads, stolen by idle ones) and 200 (~50 rows per expert: whole experts per
    thread) give the same bits on 1, 2, 3 and 5 threads (more threads than cores: other threads
    take the pieces), with idle experts among them, and stay within the int8 bound."""
    w13, w2, r13, r2 = _experts(T.Q4_1, T.Q8_0)
    x, weights, ids = _tokens(num_tokens, seed=num_tokens)
    ids = torch.remainder(ids, 6)                        # experts 6 and 7 idle
    x = x.bfloat16()
    threads = torch.get_num_threads()
    outs = []
    try:
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            outs.append(fused_experts_gguf(x, w13, int(T.Q4_1), w2, int(T.Q8_0), weights, ids))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert _relative(outs[0], fused_experts(x.float(), r13, r2, weights, ids)) < 0.03


@pytest.mark.requires_native
def test_expert_map_runs_only_this_ranks_experts():
    """Expert parallel halves: each rank's call covers its own experts; the two sum to all."""
    w13, w2, _, _ = _experts(T.Q4_1, T.Q8_0)
    x, weights, ids = _tokens(6, seed=7)
    x = x.bfloat16()
    whole = fused_experts_gguf(x, w13, int(T.Q4_1), w2, int(T.Q8_0), weights, ids).float()
    halves = torch.zeros_like(whole)
    for rank in range(2):
        expert_map = torch.full((E,), -1, dtype=torch.int64)
        expert_map[rank * 4:(rank + 1) * 4] = torch.arange(4)
        part = fused_experts_gguf(x, w13[rank * 4:(rank + 1) * 4].contiguous(), int(T.Q4_1),
                                  w2[rank * 4:(rank + 1) * 4].contiguous(), int(T.Q8_0),
                                  weights, ids, expert_map)
        halves += part.float()
    assert _relative(halves, whole) < 0.01


@pytest.mark.parametrize("q13,q2", TYPE_PAIRS[:3], ids=lambda q: T(q).name)
def test_fp32_experts_equal_the_dequantised_ones(q13, q2):
    """fp32 x is the reference precision: the per-expert loop on dequantised tiles gives the
    dequantised experts' result (no int8 step); the native kernel refuses fp32 x."""
    w13, w2, r13, r2 = _experts(q13, q2)
    x, weights, ids = _tokens(9, seed=3)
    assert fused_experts_gguf(x, w13, int(q13), w2, int(q2), weights, ids) is None
    out = gguf_fused_experts(x, w13, int(q13), w2, int(q2), weights, ids, None, None, None,
                             "silu", False)
    torch.testing.assert_close(out, fused_experts(x, r13, r2, weights, ids), atol=1e-5, rtol=1e-5)


class _Layer(torch.nn.Module):
    """The attributes of a FusedMoE that the method reads, at a chosen TP rank and size."""

    def __init__(self, tp_size: int = 1, tp_rank: int = 0, inter: int = I) -> None:
        super().__init__()
        self.tp_size, self.tp_rank, self.has_bias = tp_size, tp_rank, False
        self.local_num_experts, self.hidden_size = E, H
        self.intermediate_size = inter
        self.intermediate_size_per_partition = inter // tp_size

    def _local_expert(self, expert_id: int) -> int:
        return expert_id


def _loaded(w: torch.Tensor, qtype: int) -> torch.Tensor:
    w = w.clone()
    w.gguf_type = int(qtype)
    return w


def test_loader_keeps_blocks_and_slices_whole_blocks_per_rank():
    """TP=2 over I = 512 Q8_0 values: gate/up rows split in halves, down rows in whole blocks
    (8 of 16 per rank); the buffers hold the file's bytes, with their types."""
    inter = 512
    gate = torch.from_numpy(random_weight(T.Q8_0, inter, H, 1))
    down = torch.from_numpy(random_weight(T.Q8_0, H, inter, 2))
    for rank in range(2):
        layer, method = _Layer(tp_size=2, tp_rank=rank, inter=inter), GGUFMoEMethod("moe")
        method.create_weights(layer, E, H, inter // 2, torch.bfloat16)
        for e in range(E):
            layer.w13_qweight.weight_loader(layer.w13_qweight, _loaded(gate, T.Q8_0), "g", "w1", e)
            layer.w13_qweight.weight_loader(layer.w13_qweight, _loaded(gate, T.Q8_0), "u", "w3", e)
            layer.w2_qweight.weight_loader(layer.w2_qweight, _loaded(down, T.Q8_0), "d", "w2", e)
        method.process_weights_after_loading(layer)
        assert layer.w13_qweight.dtype == torch.uint8 and layer.w13_qweight_type == T.Q8_0
        # the kernels' code: the x8 layout of the same bytes where the x8 kernels run
        x8 = gl.GGUF_X8_LAYOUT if gl.gguf_x8_rows() else 0
        assert layer.w13_qweight_kernel_type == layer.w2_qweight_kernel_type == T.Q8_0 | x8
        w13, w2 = (_file_bytes(p, layer.w13_qweight_kernel_type)
                   for p in (layer.w13_qweight, layer.w2_qweight))
        half = inter // 2
        assert torch.equal(w13[3, :half], gate[rank * half:(rank + 1) * half])
        assert torch.equal(w13[3, half:], gate[rank * half:(rank + 1) * half])
        width = down.shape[1] // 2                      # 8 blocks of 34 bytes
        assert torch.equal(w2[5], down[:, rank * width:(rank + 1) * width])


def _file_bytes(param: torch.Tensor, code: int) -> torch.Tensor:
    """A stacked expert buffer [E, rows, row_bytes] in the file's layout (undoing x8)."""
    return gl.gguf_unpack_x8(param.data.view(-1, param.shape[-1]), code).view(param.shape)


def test_loader_errors_name_the_problem():
    layer, method = _Layer(tp_size=2, inter=I), GGUFMoEMethod("model.layers.0.mlp.experts")
    method.create_weights(layer, E, H, I // 2, torch.bfloat16)
    down = _loaded(torch.from_numpy(random_weight(T.Q4_K, H, I, 0)), T.Q4_K)
    # 256 / 2 = 128 values: half a Q4_K block on each rank.
    with pytest.raises(ValueError, match=r"would split a GGUF block \(256 values\).*"
                                         r"valid tensor_parallel_size values for this layer: "
                                         r"\[1\], or use --enable-expert-parallel"):
        layer.w2_qweight.weight_loader(layer.w2_qweight, down, "d", "w2", 0)
    layer, method = _Layer(), GGUFMoEMethod("model.layers.0.mlp.experts")
    method.create_weights(layer, E, H, I, torch.bfloat16)
    load = layer.w13_qweight.weight_loader
    load(layer.w13_qweight, _loaded(torch.from_numpy(random_weight(T.Q8_0, I, H)), T.Q8_0),
         "gate", "w1", 0)
    with pytest.raises(ValueError, match=r"GGUF type Q4_1, but this layer's other w13 experts "
                                         r"are Q8_0"):
        load(layer.w13_qweight, _loaded(torch.from_numpy(random_weight(T.Q4_1, I, H)), T.Q4_1),
             "up", "w3", 0)
    with pytest.raises(ValueError, match="IQ2_XS"):
        load(layer.w13_qweight, _loaded(torch.zeros(I, 66, dtype=torch.uint8), T.IQ2_XS),
             "blk.0.ffn_up_exps.weight", "w3", 1)
    with pytest.raises(ValueError, match=r"shard_id must be one of \['w1', 'w2', 'w3'\]"):
        load(layer.w13_qweight, _loaded(torch.zeros(I, 34), T.Q8_0), "x", "w4", 1)
