"""`GateLinear` (vLLM 0.33): the replicated router projection of a MoE layer, hidden -> logits.

vLLM picks among GPU kernels here; on CPU (and as vLLM's own fallback) it is `ReplicatedLinear`
with two extras kept: `out_dtype` (the logits' dtype, settable after construction) and
`force_fp32_compute` (the weight stored and multiplied in fp32).
"""

import torch

from minivllm.model_executor.layers.linear import ReplicatedLinear
from minivllm.model_executor.layers.quantization.base_config import QuantizationConfig


class GateLinear(ReplicatedLinear):
    """`forward(x [T, H])` -> `(logits [T, E], None)` (or the logits alone with
    `return_bias=False`)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 out_dtype: torch.dtype | None = None, params_dtype: torch.dtype | None = None,
                 force_fp32_compute: bool = False, skip_bias_add: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 return_bias: bool = True) -> None:
        if force_fp32_compute:
            params_dtype = torch.float32
        super().__init__(input_size, output_size, bias=bias, skip_bias_add=skip_bias_add,
                         params_dtype=params_dtype, quant_config=quant_config, prefix=prefix,
                         return_bias=return_bias)
        self.out_dtype = out_dtype

    def set_out_dtype(self, out_dtype: torch.dtype) -> None:
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        weight = getattr(self, "weight", None)
        if weight is not None and weight.dtype != x.dtype and weight.is_floating_point():
            x = x.to(weight.dtype)                      # an fp32 gate on bf16 activations
        out = super().forward(x)
        logits, bias = out if isinstance(out, tuple) else (out, None)
        if self.out_dtype is not None and logits.dtype != self.out_dtype:
            logits = logits.to(self.out_dtype)
        return (logits, bias) if self.return_bias else logits
