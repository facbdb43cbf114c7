"""The MoE kernel's path for CPUs without AMX (`csrc/fused_moe.cpp`, bf16 dot products):
forced with use_amx=False, it equals fp32 maths within bf16 rounding and the AMX path within a
rounding of its own, in the decode layout (pieces of 64 weight rows of every active expert) and
the prompt layout (whole experts per thread), with idle experts and other ranks' experts."""

import ctypes
import os
import subprocess

import pytest
import torch

from minivllm import _custom_ops as ops
from minivllm.model_executor.layers.fused_moe.cpu_fused_moe import fused_experts_bf16

from tests.csrc._moe_helpers import (E, expert_weights, fused_moe_py, rounded_reference,
                                     routed_tokens)

pytestmark = pytest.mark.requires_native


@pytest.fixture(scope="module")
def weights():
    return expert_weights(1)


_routing = routed_tokens


def _dot(x, w1, w2, w, ids, expert_map=None) -> torch.Tensor:
    out = fused_experts_bf16(x, w1, w2, w, ids, expert_map, use_amx=False)
    if out is None:
        pytest.skip("this build has neither AVX-512 nor AVX2: the torch expert loop stays in use")
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 400])   # 400: whole experts per thread
def test_matches_fp32_and_the_amx_path(weights, num_tokens):
    w1, w2 = weights
    x, w, ids = _routing(num_tokens, 2, seed=num_tokens)
    out = _dot(x, w1, w2, w, ids)
    fp32 = fused_moe_py.fused_experts(x.float(), w1.float(), w2.float(), w, ids)
    torch.testing.assert_close(out.float(), fp32, rtol=0.03, atol=0.02)
    # fp32 GEMMs rounded where the kernel rounds (bf16 gate/up, h, down): a few bf16 ulps apart
    torch.testing.assert_close(out, rounded_reference(x, w1, w2, w, ids), rtol=2 ** -6,
                               atol=2 ** -8)
    if ops._has_amx:   # both paths sum in fp32, in another order: a bf16 rounding or so apart
        amx = fused_experts_bf16(x, w1, w2, w, ids)
        torch.testing.assert_close(out.float(), amx.float(), rtol=2 ** -6, atol=2 ** -8)


def test_idle_experts_and_expert_map(weights):
    w1, w2 = weights
    x, w, _ = _routing(40, 2, seed=5)
    ids = torch.randint(0, 3, (40, 2), generator=torch.Generator().manual_seed(6))  # 5 idle
    whole = _dot(x, w1, w2, w, ids)
    fp32 = fused_moe_py.fused_experts(x.float(), w1.float(), w2.float(), w, ids)
    torch.testing.assert_close(whole.float(), fp32, rtol=0.03, atol=0.02)
    halves = []
    for rank in range(2):                      # rank r holds global experts 4r .. 4r + 3
        expert_map = torch.full((E,), -1, dtype=torch.int64)
        expert_map[4 * rank:4 * rank + 4] = torch.arange(4)
        halves.append(_dot(x, w1[4 * rank:4 * rank + 4].contiguous(),
                           w2[4 * rank:4 * rank + 4].contiguous(), w, ids, expert_map))
    torch.testing.assert_close(halves[0].float() + halves[1].float(), whole.float(),
                               rtol=2 ** -7, atol=whole.float().abs().max().item() * 2 ** -8)


def test_without_amx_decode_steps_take_the_dot_kernel_and_prompts_the_torch_loop(weights,
                                                                                 monkeypatch):
    """The choice a CPU without AMX makes (use_amx=None): with AVX-512 BF16 (Zen 4), below 8
    rows per expert on average the dot kernel answers, at 8 or more (prompt-sized steps, where
    oneDNN's blocked GEMMs win) the kernel declines and fused_experts runs the torch loop;
    without AVX-512 BF16 (Ice Lake) the kernel answers at every size."""
    w1, w2 = weights
    x, w, ids = _routing(40, 2, seed=9)                       # 80 pairs over 8 experts: 10 each
    whole = _dot(x, w1, w2, w, ids)                           # skips without AVX-512
    monkeypatch.setattr(ops, "_has_amx", False)
    monkeypatch.setattr(ops, "cpu_has", lambda flag: False)   # as on Ice Lake
    assert torch.equal(fused_experts_bf16(x, w1, w2, w, ids), whole)
    monkeypatch.setattr(ops, "cpu_has", lambda flag: flag == "avx512_bf16")   # as on Zen 4
    assert fused_experts_bf16(x, w1, w2, w, ids) is None
    small = fused_experts_bf16(x[:3], w1, w2, w[:3], ids[:3])  # 6 pairs: under 1 per expert
    assert small is not None and torch.equal(small, _dot(x[:3], w1, w2, w[:3], ids[:3]))
    out = fused_moe_py.fused_experts(x, w1, w2, w, ids)      # the torch loop, same maths
    fp32 = fused_moe_py.fused_experts(x.float(), w1.float(), w2.float(), w, ids)
    torch.testing.assert_close(out.float(), fp32, rtol=0.03, atol=0.02)


class _PortableKernels:
    """fused_moe.cpp (with gemm_amx.cpp, whose entry points it calls) built with extra `flags`,
    typed as `_custom_ops` types its functions: what fused_experts_bf16 finds as native_lib()."""

    def __init__(self, folder, flags: list[str]) -> None:
        out = folder / "moe_portable.so"
        subprocess.run([ops.cxx_compiler(), *ops._FLAGS, *flags, str(ops._CSRC / "fused_moe.cpp"),
                        str(ops._CSRC / "gemm_amx.cpp"), "-o", str(out)], check=True,
                       capture_output=True, timeout=300)
        lib = ctypes.CDLL(str(out))
        fn = lib.minivllm_fused_experts_bf16
        fn.argtypes, fn.restype = ops._SIGNATURES["minivllm_fused_experts_bf16"], ctypes.c_int
        self.minivllm_fused_experts_bf16 = fn


@pytest.mark.skipif(os.uname().machine != "x86_64" or not ops.cpu_has("avx2"),
                    reason="the AVX2 build of the kernel needs an x86 CPU with AVX2")
def test_avx2_build_agrees(weights, tmp_path, monkeypatch):
    """-mno-avx512f: the AVX2 dot products (Zen 2/3; 2 rows of x per weight tile, each bf16 pair
    through two fp32 FMAs), on decode- and prompt-sized groups: equal to the rounded reference
    and to this CPU's own build within a bf16 rounding."""
    w1, w2 = weights
    cases = [_routing(n, 2, seed=n) for n in (1, 3, 5, 64, 400)]
    own = [_dot(x, w1, w2, w, ids) for x, w, ids in cases]
    kernels = _PortableKernels(tmp_path, ["-mno-avx512f"])
    monkeypatch.setattr(ops, "native_lib", lambda: kernels)
    for (x, w, ids), reference in zip(cases, own):
        out = fused_experts_bf16(x, w1, w2, w, ids, use_amx=False)
        assert out is not None, "the AVX2 build refused"
        torch.testing.assert_close(out, rounded_reference(x, w1, w2, w, ids), rtol=2 ** -6,
                                   atol=2 ** -8)
        torch.testing.assert_close(out.float(), reference.float(), rtol=2 ** -6, atol=2 ** -8)
