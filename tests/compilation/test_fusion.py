"""The post-grad fusion pass: which (linear, SiluAndMul) pairs it folds, and that the folded op
computes the same thing; in a compiled Llama every MLP's pair is folded."""

import torch
import torch.fx

from minivllm.compilation.fusion import LinearSiluMulFusionPass
from minivllm.model_executor.kernels.cpu_linear import pack_for_cpu

OPS = torch.ops.minivllm


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _trace(fn) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(fn)
    # symbolic_trace records OpOverloadPackets; the pass matches overloads, as in post-grad graphs
    for node in gm.graph.nodes:
        if node.op == "call_function" and hasattr(node.target, "default"):
            node.target = node.target.default
    gm.recompile()
    return gm


def mlp(x, w):
    return OPS.silu_and_mul(OPS.cpu_linear(x, w, None))


def shared(x, w):                     # the projection is also used elsewhere: nothing to fold
    y = OPS.cpu_linear(x, w, None)
    return OPS.silu_and_mul(y), y


def not_a_linear(x):                  # the activation of something else: left alone
    return OPS.silu_and_mul(x * 2)


def test_pass_folds_only_a_linear_feeding_only_the_activation():
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(64, 32) * 0.1).bfloat16(), requires_grad=False)
    pack_for_cpu(layer)
    x = torch.randn(5, 32).bfloat16()
    expected = mlp(x, layer.weight)

    gm = _trace(mlp)
    fusion = LinearSiluMulFusionPass()
    fusion(gm.graph)
    gm.recompile()
    assert fusion.fused == 1 and _targets(gm) == [OPS.cpu_linear_silu_mul.default]
    assert torch.equal(gm(x, layer.weight), expected)

    for fn in (shared, not_a_linear):
        gm = _trace(fn)
        before = _targets(gm)
        fusion = LinearSiluMulFusionPass()
        fusion(gm.graph)
        assert fusion.fused == 0 and _targets(gm) == before
    assert LinearSiluMulFusionPass().uuid() == LinearSiluMulFusionPass().uuid()
