"""CustomOp dispatch from `custom_ops`, registration rules, and out-of-tree substitution."""

import pytest
import torch

from minivllm.config import get_cached_compilation_config, set_current_vllm_config
from minivllm.model_executor.custom_op import CustomOp, PluggableLayer, op_registry_oot
from minivllm.model_executor.layers.activation import SiluAndMul
from minivllm.model_executor.layers.layernorm import RMSNorm
from minivllm.model_executor.layers.logits_processor import LogitsProcessor
from tests.model_executor.layers._helpers import layer_context, make_vllm_config


@pytest.mark.parametrize("custom_ops, native", [
    (["all"], False), (["none"], True), (["none", "+rms_norm"], False),
    (["all", "-rms_norm"], True), (["-silu_and_mul", "all"], False)])
def test_dispatch_follows_custom_ops(custom_ops, native):
    with layer_context(custom_ops):
        norm = RMSNorm(8)
        config = get_cached_compilation_config()
    expected = norm.forward_native if native else norm.forward_cpu
    assert norm._forward_method == expected
    assert ("rms_norm" in config.disabled_custom_ops) is native
    assert ("rms_norm" in config.enabled_custom_ops) is not native


def test_enforce_enable_wins_over_none():
    class Forced(SiluAndMul):
        def __init__(self):
            CustomOp.__init__(self, enforce_enable=True)

    with layer_context(["none"]):
        plain, forced = SiluAndMul(), Forced()
    assert plain._forward_method == plain.forward_native
    assert forced._forward_method == forced.forward_cpu


def test_custom_ops_errors():
    with layer_context(["all", "+rms_norm", "-rms_norm"]):
        with pytest.raises(ValueError, match="both enable and disable"):
            RMSNorm(4)
    config = make_vllm_config()
    config.compilation_config.custom_ops = ["+rms_norm"]
    with set_current_vllm_config(config), pytest.raises(ValueError, match="exactly one"):
        RMSNorm(4)
    config.compilation_config.custom_ops = ["all", "none"]
    with set_current_vllm_config(config), pytest.raises(ValueError, match="exactly one"):
        SiluAndMul()


def test_construction_needs_a_current_config():
    with pytest.raises(AssertionError, match="Current vLLM config is not set"):
        RMSNorm(4)


def test_duplicate_registration_fails():
    with pytest.raises(AssertionError, match="Duplicate op name: rms_norm"):
        @CustomOp.register("rms_norm")
        class Again(CustomOp):
            pass
    with pytest.raises(AssertionError, match="Duplicate op name: logits_processor"):
        PluggableLayer.register("logits_processor")(type("X", (PluggableLayer,), {}))


def test_forward_calls_the_bound_method():
    with layer_context():
        op = SiluAndMul()
    x = torch.randn(3, 8)
    torch.testing.assert_close(op(x), op.forward_native(x))


def test_out_of_tree_substitution_by_class_name():
    @RMSNorm.register_oot
    class MyRMSNorm(RMSNorm):
        def forward_native(self, x, residual=None):
            return x * 0

        forward_cpu = forward_native

    @PluggableLayer.register_oot(name="LogitsProcessor")
    class MyLogits(LogitsProcessor):
        pass

    try:
        with layer_context():
            norm, logits = RMSNorm(4), LogitsProcessor(10)
        assert type(norm) is MyRMSNorm and type(logits) is MyLogits
        assert norm(torch.ones(2, 4)).abs().sum() == 0
    finally:
        op_registry_oot.pop("RMSNorm")
        op_registry_oot.pop("LogitsProcessor")
    with layer_context():
        assert type(RMSNorm(4)) is RMSNorm
