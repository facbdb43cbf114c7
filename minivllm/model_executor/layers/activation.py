"""Activation functions; gated ones take `[..., 2 * d]` and return `[..., d]`.

`get_act_fn` / `get_act_and_mul_fn` map an HF `hidden_act` name to a module; an unknown name
raises `ValueError` listing the known ones.
"""

import math
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm import _custom_ops as ops
from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.kernels.activation import silu_and_mul, silu_and_mul_torch


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """`silu(x[..., :d]) * x[..., d:]` (the gate/up halves of a fused gate_up_proj output)."""

    def __init__(self, *, compile_native: bool = True) -> None:
        super().__init__(compile_native=compile_native)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_torch(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        # bf16: the native kernel (same roundings as forward_native); compiled graphs keep it as
        # one op, which the fusion pass folds into a preceding bf16 linear.
        if x.dtype == torch.bfloat16 and x.dim() == 2 and ops.native_available():
            if torch.compiler.is_compiling():
                return torch.ops.minivllm.silu_and_mul(x)
            return silu_and_mul(x)
        return self.forward_native(x)


@CustomOp.register("gelu_and_mul")
class GeluAndMul(CustomOp):
    """`gelu(x[..., :d]) * x[..., d:]`, exact ("none") or tanh-approximated GELU."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


@CustomOp.register("relu2")
class ReLUSquaredActivation(CustomOp):
    """`relu(x) ** 2` (Primer / Nemotron MLPs)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


@CustomOp.register("silu_and_mul_with_clamp")
class SiluAndMulWithClamp(CustomOp):
    """SwiGLU with clamped inputs: `silu(min(gate, L)) * clamp(up, -L, L)`, L = `swiglu_limit`."""

    def __init__(self, swiglu_limit: float, *, compile_native: bool = True) -> None:
        super().__init__(compile_native=compile_native)
        self.swiglu_limit = float(swiglu_limit)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        gate = x[..., :d].clamp(max=self.swiglu_limit)
        up = x[..., d:].clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return F.silu(gate) * up

    def extra_repr(self) -> str:
        return f"swiglu_limit={self.swiglu_limit}"


@CustomOp.register("swiglustep_and_mul")
class SwigluStepAndMul(CustomOp):
    """SwiGLU clipped after the activation (Ling 3.0): `min(silu(gate), L) * clamp(up, -L, L)`."""

    def __init__(self, limit: float = 7.0) -> None:
        super().__init__()
        if limit is None:
            raise ValueError("SwigluStepAndMul needs a limit")
        self.limit = limit

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)

    def extra_repr(self) -> str:
        return f"limit={self.limit}"


@CustomOp.register("fatrelu_and_mul")
class FatreluAndMul(CustomOp):
    """`fatrelu(x[..., :d]) * x[..., d:]`: gates at or below `threshold` become 0 (MiniCPM)."""

    def __init__(self, threshold: float = 0.0) -> None:
        super().__init__()
        self.threshold = threshold

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        gate = F.threshold(x[..., :d], self.threshold, 0.0)
        return gate * x[..., d:]

    def extra_repr(self) -> str:
        return f"threshold={self.threshold}"


@CustomOp.register("mul_and_silu")
class MulAndSilu(CustomOp):
    """`x[..., :d] * silu(x[..., d:])`: the halves in the other order (Arctic, some MoE experts)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return x[..., :d] * F.silu(x[..., d:])


@CustomOp.register("gelu_new")
class NewGELU(CustomOp):
    """GPT-2's tanh GELU, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))


@CustomOp.register("gelu_fast")
class FastGELU(CustomOp):
    """The same tanh GELU written as `tanh(0.79788456 x (1 + 0.044715 x^2))`."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


@CustomOp.register("quick_gelu")
class QuickGELU(CustomOp):
    """`x * sigmoid(1.702 x)` (CLIP's GELU approximation)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


@CustomOp.register("xielu")
class XIELU(CustomOp):
    """xIELU (arXiv 2411.13010, Apertus): a quadratic for x > 0, an expm1 branch below.

    `alpha_p` / `alpha_n` are stored pre-softplus (`[1]` each, as transformers saves them):
    x > 0: `softplus(alpha_p) x^2 + beta x`; else `(expm1(min(x, eps)) - x) a_n + beta x` with
    `a_n = beta + softplus(alpha_n)`.
    """

    def __init__(self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8, beta: float = 0.5,
                 eps: float = -1e-6, dtype: torch.dtype | None = None,
                 with_vector_loads: bool = False) -> None:
        super().__init__()
        # NOTE: vLLM defaults to bf16; here the model's dtype (the default dtype while the
        # model is built), so an fp32 run keeps fp32 parameters as transformers' .float() does.
        dtype = dtype or torch.get_default_dtype()
        # softplus^-1(a) = log(expm1(a)): the stored value that gives `a` after softplus.
        self.alpha_p = nn.Parameter(_inverse_softplus(alpha_p_init, dtype), requires_grad=False)
        self.alpha_n = nn.Parameter(_inverse_softplus(alpha_n_init - beta, dtype),
                                    requires_grad=False)
        self.register_buffer("beta", torch.tensor(beta, dtype=dtype))
        self.register_buffer("eps", torch.tensor(eps, dtype=dtype))
        self.with_vector_loads = with_vector_loads   # a CUDA-kernel knob in vLLM; unused here

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        positive = alpha_p * x * x + self.beta * x
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x
        return torch.where(x > 0, positive, negative)


def _inverse_softplus(value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.log(torch.expm1(torch.tensor(value, dtype=dtype))).unsqueeze(0)   # [1]


class _ModuleRegistry(Mapping[str, nn.Module]):
    """name -> a module, built at each lookup (a CustomOp reads the current config when it is
    constructed). Indexing gives a module, as vLLM's `LazyDict` registries do for model files
    that write `_ACTIVATION_REGISTRY[name]`; unlike vLLM's, no instance is shared."""

    def __init__(self, factories: dict[str, Callable[[], nn.Module]]) -> None:
        self.factories = factories

    def __getitem__(self, name: str) -> nn.Module:
        return self.factories[name]()

    def __contains__(self, name: object) -> bool:       # without building (Mapping's would)
        return name in self.factories

    def __iter__(self) -> Iterator[str]:
        return iter(self.factories)

    def __len__(self) -> int:
        return len(self.factories)


# name (as in HF configs' `hidden_act`) -> factory.
_ACTIVATION_REGISTRY = _ModuleRegistry({
    "gelu": nn.GELU,
    "gelu_fast": FastGELU,
    "gelu_new": NewGELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
    "relu2": ReLUSquaredActivation,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "quick_gelu": QuickGELU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "xielu": XIELU,
})

# Gated forms: `[..., 2 * d]` -> `[..., d]`.
_ACTIVATION_AND_MUL_REGISTRY = _ModuleRegistry({
    "gelu": GeluAndMul,
    "geglu": GeluAndMul,
    "gelu_pytorch_tanh": lambda: GeluAndMul(approximate="tanh"),
    "silu": SiluAndMul,
    "swish": SiluAndMul,
})


def get_act_fn(act_fn_name: str) -> nn.Module:
    """A new module for an HF activation name (case-insensitive; `torch.nn.modules.*.X` too)."""
    name = act_fn_name.lower()
    if name.startswith("torch.nn.modules."):        # sentence-transformers' dense layers
        name = name.rsplit(".", 1)[-1]
        if name == "identity":
            return nn.Identity()
    return _lookup(_ACTIVATION_REGISTRY, name, act_fn_name)()


def get_act_and_mul_fn(act_fn_name: str) -> nn.Module:
    """A new gated activation (`act(x[..., :d]) * x[..., d:]`) for an HF activation name."""
    return _lookup(_ACTIVATION_AND_MUL_REGISTRY, act_fn_name.lower(), act_fn_name)()


def _lookup(registry: _ModuleRegistry, name: str, given: str) -> Callable[[], nn.Module]:
    if name not in registry:
        raise ValueError(f"Activation function {given!r} is not supported; supported: "
                         f"{', '.join(sorted(registry))}")
    return registry.factories[name]


@CustomOp.register("gelu_and_mul_sparse")
class GeluAndMulSparse(CustomOp):
    """`gelu(sparse(x[..., :d])) * x[..., d:]`: Gemma 3n's activation sparsity.

    The gate keeps only its values above a per-token cutoff, `mean + std * Phi^-1(s)` over the
    last dim (Phi^-1: the standard normal quantile), shifted down by that cutoff: if the gate's
    values were gaussian, a fraction `s` of them would be zeroed (a "gaussian top-k")."""

    def __init__(self, activation_sparsity: float, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        if not 0.0 < activation_sparsity < 1.0:
            # 0 keeps everything (GeluAndMul does that); 1 would put the cutoff at +inf.
            raise ValueError(f"activation_sparsity must be in (0, 1), got {activation_sparsity}; "
                             "use GeluAndMul for a dense gate")
        self.approximate = approximate
        self.activation_sparsity = activation_sparsity
        quantile = torch.distributions.Normal(0.0, 1.0).icdf(
            torch.tensor(activation_sparsity, dtype=torch.float32))
        self.std_multiplier = float(quantile)

    def _sparsify(self, gate: torch.Tensor) -> torch.Tensor:
        # gate: [..., d]; population std (not Bessel-corrected), as the reference model.
        mean = gate.mean(dim=-1, keepdim=True)
        std = gate.std(dim=-1, keepdim=True, unbiased=False)
        return F.relu(gate - (mean + std * self.std_multiplier))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        gate = self._sparsify(x[..., :d])
        return F.gelu(gate, approximate=self.approximate) * x[..., d:]

    def extra_repr(self) -> str:
        return f"activation_sparsity={self.activation_sparsity}, approximate={self.approximate!r}"
