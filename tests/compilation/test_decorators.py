"""support_torch_compile: call forms, dim inference, class surgery, eager default, compiled mode."""

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig

from minivllm.compilation.decorators import ignore_torch_compile, support_torch_compile
from minivllm.config import (CompilationConfig, CompilationMode, ModelConfig, VllmConfig,
                             set_current_vllm_config)
from minivllm.forward_context import set_forward_context
from minivllm.sequence import IntermediateTensors


def _config(mode: CompilationMode = CompilationMode.NONE, backend: str = "inductor") -> VllmConfig:
    hf = LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, vocab_size=64)
    return VllmConfig(model_config=ModelConfig(model="dummy", hf_config=hf),
                      compilation_config=CompilationConfig(mode=mode, backend=backend))


@support_torch_compile
class Bare(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", scale: float = 1.0) -> None:
        super().__init__()
        self.prefix, self.scale = prefix, scale
        self.proj = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                it: IntermediateTensors | None = None, flag: bool = False) -> torch.Tensor:
        self.calls += 1
        return self.proj(x) * self.scale


@support_torch_compile(dynamic_arg_dims={"x": {0: "b"}, "positions": [-1]})
class WithDims(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", extra: int = 0) -> None:
        super().__init__()
        self.extra = extra
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)) + positions.unsqueeze(-1).float()


@support_torch_compile(dynamic_arg_dims={"x": 0})
class Sub(WithDims):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, extra=7)
        self.sub_built = True


class NoConfigArgs(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_bare_form_infers_tensor_and_intermediate_dims():
    cfg = _config()
    with set_current_vllm_config(cfg):
        model = Bare(prefix="model", scale=2.0)   # vllm_config taken from the current config
    assert model.vllm_config is cfg and model.prefix == "model" and model.scale == 2.0
    assert model.do_not_compile
    x = torch.randn(3, 4)
    assert torch.equal(model(x), model.proj(x) * 2.0)


def test_keyword_forms_and_errors():
    assert support_torch_compile()(NoConfigArgs) is NoConfigArgs
    with pytest.raises(ValueError, match="No dynamic dimensions found"):
        class NoTensors(nn.Module):
            def forward(self, x: "torch.Tensor", n: int):   # string annotations do not count
                return x

        support_torch_compile(NoTensors)
    with pytest.raises(ValueError, match="Argument y not found"):
        support_torch_compile(dynamic_arg_dims={"y": 0})(WithDims)
    with pytest.raises(TypeError, match="forward"):
        support_torch_compile(type("NoForward", (), {}))


def test_original_init_without_config_or_prefix():
    model = support_torch_compile(dynamic_arg_dims={"x": 0})(NoConfigArgs)(4, vllm_config=_config())
    assert model.proj.in_features == 4
    with pytest.raises(TypeError, match="positional argument of type str"):
        NoConfigArgs("4", vllm_config=_config())


def test_subclass_of_decorated_class_runs_both_wrappers():
    cfg = _config()
    model = Sub(vllm_config=cfg, prefix="p")
    assert model.extra == 7 and model.sub_built and model.vllm_config is cfg
    x, pos = torch.randn(2, 4), torch.arange(2)
    assert torch.equal(model(x, pos), model.forward(x, pos))


def test_call_replaced_so_forward_hooks_do_not_fire():
    model = WithDims(vllm_config=_config())
    fired = []
    model.register_forward_hook(lambda *a: fired.append(1))
    model(torch.randn(2, 4), torch.arange(2))
    assert fired == []


def test_ignore_torch_compile_and_enable_if():
    @ignore_torch_compile
    class Ignored(WithDims):
        pass

    cfg = _config(CompilationMode.VLLM_COMPILE)
    assert Ignored(vllm_config=cfg).do_not_compile
    assert not WithDims(vllm_config=cfg).do_not_compile
    gated = support_torch_compile(enable_if=lambda c: False)(type("Gated", (WithDims,), {}))
    assert gated(vllm_config=cfg).do_not_compile
    assert WithDims(vllm_config=_config(CompilationMode.STOCK_TORCH_COMPILE)).do_not_compile


def test_compiled_mode_matches_eager_and_compiles_once():
    torch.manual_seed(0)
    cfg = _config(CompilationMode.VLLM_COMPILE, backend="eager")
    model = Sub(vllm_config=cfg)
    for n in (5, 3, 8):
        x, pos = torch.randn(n, 4), torch.arange(n)
        assert torch.allclose(model(x, pos), model.forward(x, pos))
    compiled = model._compiled_forward
    assert compiled is not None
    model(torch.randn(4, 4), torch.arange(4))
    assert model._compiled_forward is compiled


def test_steps_up_to_eager_max_tokens_stay_eager():
    """By default every step runs compiled, one-token ones too; with eager_max_tokens = n,
    steps of up to n tokens run eagerly and larger ones compile."""
    cfg = _config(CompilationMode.VLLM_COMPILE, backend="eager")
    assert cfg.compilation_config.eager_max_tokens == 0
    model = Bare(vllm_config=cfg)
    model(torch.randn(1, 4))
    assert model._compiled_forward is not None
    cfg.compilation_config.eager_max_tokens = 1
    model = Bare(vllm_config=cfg)
    model(torch.randn(1, 4))
    assert model._compiled_forward is None and model.calls == 1
    model(torch.randn(3, 4))
    assert model._compiled_forward is not None
    cfg.compilation_config.eager_max_tokens = 3
    model = Bare(vllm_config=cfg)
    model(torch.randn(3, 4))
    assert model._compiled_forward is None


def test_skip_compiled_runs_eagerly():
    cfg = _config(CompilationMode.VLLM_COMPILE, backend="eager")
    model = Bare(vllm_config=cfg)
    with set_forward_context(None, cfg, skip_compiled=True):
        model(torch.randn(2, 4))
    assert model._compiled_forward is None and model.calls == 1


@pytest.mark.slow
@pytest.mark.requires_native
def test_inductor_matches_eager():
    torch.manual_seed(0)
    model = WithDims(vllm_config=_config(CompilationMode.VLLM_COMPILE, backend="inductor"))
    for n in (4, 9):
        x, pos = torch.randn(n, 4), torch.arange(n)
        assert torch.allclose(model(x, pos), model.forward(x, pos), atol=1e-6)


@support_torch_compile(dynamic_arg_dims={"x": 0})
class Branchy(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("offset", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                double: bool = False) -> torch.Tensor:
        y = self.proj(x) + self.offset
        if bias is not None:
            y = y + bias
        return y * 2 if double else y


def test_guards_on_arguments_and_buffers_are_kept_and_module_guards_dropped():
    """The compiled forward drops dynamo's guards on the module tree (fixed after loading: they
    cost ~1 ms per step) but keeps those on its arguments and on buffers: other argument
    branches still recompile."""
    from minivllm.compilation.decorators import _input_guards_only

    class Guard:
        def __init__(self, name: str) -> None:
            self.name = name

    names = ["self._modules['proj']._forward_hooks", "dict(type(self).__mro__[1])",
             "G['__builtins_dict___0']['len']", "self._modules['proj']._parameters['weight']",
             "self._buffers['offset']", "x", "bias", ""]
    assert _input_guards_only([Guard(n) for n in names]) == [False] * 4 + [True] * 4
    torch.manual_seed(0)
    model = Branchy(vllm_config=_config(CompilationMode.VLLM_COMPILE, backend="eager"))
    x, bias = torch.randn(3, 4), torch.randn(4)
    for args in [(x,), (x, bias), (x, None, True), (x, bias, True), (torch.randn(6, 4),)]:
        assert torch.allclose(model(*args), model.forward(*args))


@pytest.mark.slow
@pytest.mark.requires_native
def test_rebound_buffer_recompiles_under_inductor():
    """A buffer rebound to another dtype after compiling (as an eager step does to the rotary
    cache) recompiles; without its guard inductor's graph would read fp64 data as fp32."""
    torch.manual_seed(0)
    model = Branchy(vllm_config=_config(CompilationMode.VLLM_COMPILE, backend="inductor"))
    x = torch.randn(3, 4)
    assert torch.allclose(model(x), model.forward(x), atol=1e-6)
    model.offset = model.offset.double()
    y = model(x)
    assert y.dtype == torch.float64 and torch.allclose(y, model.forward(x), atol=1e-6)
