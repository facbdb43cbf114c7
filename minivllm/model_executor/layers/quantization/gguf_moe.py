"""GGUF MoE experts kept in their block formats (`quantization="gguf"`).

llama.cpp stores a MoE layer's experts as three stacked tensors `ffn_{gate,up,down}_exps`
[E, rows, cols]; the GGUF loader yields each expert's rows as `experts.{e}.{gate,up,down}_proj
.qweight` (uint8 block rows, or a float tensor for F32/F16/BF16, with its `gguf_type`). This
method copies this rank's part of each into one buffer per parameter as it arrives:

- `w13_qweight` uint8 [E_local, 2 * I_p, row bytes of H]: each expert's gate rows, then its up
  rows (the intermediate dimension sliced for tensor parallelism: whole rows);
- `w2_qweight` uint8 [E_local, H, row bytes of I_p]: the down rows, this rank's whole blocks of
  the intermediate dimension (a TP size that would split a block is refused with the valid ones);

with `layer.w13_qweight_type` / `layer.w2_qweight_type` (`*_kernel_type`: what the kernels take,
with the x8 layout bit on CPUs with the x8 kernels, see `gguf_repack_for_cpu`). No dequantised
copy is kept. bf16 SiLU experts without biases run in one native call (`fused_experts_gguf`:
int8 dot kernels or AMX strips per expert, CPU-graph recordable); anything else (fp32 reference
runs, other activations, biases) loops over the active experts with `gguf_matmul`, as the
packed linears compute.
"""

from typing import Any

import gguf
import torch
from torch import nn

from minivllm.model_executor.kernels.gguf_linear import (GGUF_FLOAT_TYPES, check_gguf_type,
                                                         gguf_matmul, gguf_repack_for_cpu,
                                                         gguf_x8_rows)
from minivllm.model_executor.kernels.op_library import register_op
from minivllm.model_executor.layers.fused_moe.cpu_fused_moe import fused_experts_gguf
from minivllm.model_executor.layers.fused_moe.fused_moe import (fused_experts, fused_experts_fake,
                                                                gated_activation, run_experts)
from minivllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from minivllm.model_executor.layers.quantization.gguf_sharding import gguf_split_columns
from minivllm.model_executor.parameter import set_weight_attrs

_PARAMS = {"w1": "w13_qweight", "w3": "w13_qweight", "w2": "w2_qweight"}


class GGUFMoEMethod(FusedMoEMethodBase):
    """A FusedMoE layer's experts on their packed GGUF blocks."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix     # named in load errors

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        # Shapes depend on the tensors' types, known only as they load: empty placeholders,
        # filled in place after loading.
        for name in ("w13_qweight", "w2_qweight"):
            param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {"weight_loader": self._loader(layer),
                                     "is_gguf_weight": True})
        e, i, h = num_experts, intermediate_size_per_partition, hidden_size
        if layer.has_bias:       # biases are plain tensors, loaded by the layer's own loader
            for name, shape in (("w13_bias", (e, 2 * i)), ("w2_bias", (e, h))):
                param = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
                layer.register_parameter(name, param)
                set_weight_attrs(param, extra_weight_attrs)
        else:
            layer.w13_bias = layer.w2_bias = None
        layer.__dict__["_gguf_moe"] = {}       # param name -> (qtype, buffer)
        layer._gguf_dtype = params_dtype

    def _loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, weight_name: str, shard_id: str,
                 expert_id: int, return_success: bool = False) -> bool | None:
            if shard_id not in _PARAMS:
                raise ValueError(f"shard_id must be one of {sorted(_PARAMS)}, got {shard_id!r}")
            local = layer._local_expert(expert_id)
            if local < 0:                       # another rank's expert (expert parallel)
                return False if return_success else None
            qtype = int(getattr(loaded, "gguf_type", 0))     # 0: GGML F32
            if qtype not in GGUF_FLOAT_TYPES:
                check_gguf_type(qtype, weight_name)   # never silently dequantised
            i_p = layer.intermediate_size_per_partition
            if shard_id == "w2":                # [H, I]: this rank's whole blocks of I
                part, row = loaded[:, self._columns(layer, qtype, loaded.shape[1])], 0
            else:                               # [I, H]: this rank's rows
                part = loaded.narrow(0, layer.tp_rank * i_p, i_p)
                row = 0 if shard_id == "w1" else i_p
            self._store(layer, _PARAMS[shard_id], qtype, local, row, part, weight_name)
            return True if return_success else None

        return load

    def _columns(self, layer: nn.Module, qtype: int, row_width: int) -> slice:
        """This rank's part of a down row (bytes for block types, elements for float ones)."""
        inter = layer.intermediate_size
        return gguf_split_columns(
            qtype, row_width, inter, layer.tp_size, layer.tp_rank,
            f"the experts' down projection in {self.prefix} (intermediate size {inter})",
            hint=", or use --enable-expert-parallel")

    def _store(self, layer: nn.Module, name: str, qtype: int, local: int, row: int,
               part: torch.Tensor, weight_name: str) -> None:
        """Copy one expert's shard into its place in the parameter's buffer (allocated at the
        first shard, when the type and the row width are known; untouched pages cost nothing)."""
        state = layer.__dict__["_gguf_moe"]
        if name not in state:
            rows = 2 * layer.intermediate_size_per_partition if name == "w13_qweight" \
                else layer.hidden_size
            dtype = layer._gguf_dtype if qtype in GGUF_FLOAT_TYPES else torch.uint8
            state[name] = (qtype, torch.empty(layer.local_num_experts, rows, part.shape[1],
                                              dtype=dtype))
        have, buffer = state[name]
        if have != qtype:
            raise ValueError(f"{weight_name}: GGUF type {_type_name(qtype)}, but this layer's "
                             f"other {name[:3]} experts are {_type_name(have)}: the gate and up "
                             f"experts of a layer must share one type ({self.prefix})")
        target = buffer[local, row:row + part.shape[0]]
        if target.shape != part.shape:
            raise ValueError(f"{weight_name}: shape {tuple(part.shape)}, expected "
                             f"{tuple(target.shape)} ({self.prefix})")
        target.copy_(part)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        state = layer.__dict__.pop("_gguf_moe", None)
        if not state:
            return                               # nothing loaded: load_weights named it
        for name, (qtype, buffer) in state.items():
            param = getattr(layer, name)
            param.data = buffer
            # Already in its final allocation: moving it into the worker's huge-page arena
            # would hold two copies at the peak.
            param.keep_in_place = True
            setattr(layer, f"{name}_type", qtype)
            # CPUs with the x8 kernels (AVX2, AVX-512 VNNI): the x8 layout of the
            # same bytes, each expert's rows whole groups of gguf_x8_rows() (8 or 16 rows;
            # gguf_linear.gguf_repack_for_cpu); the kernels take the code with its layout bit.
            code, group = qtype, gguf_x8_rows()
            if qtype not in GGUF_FLOAT_TYPES and group and buffer.shape[1] % group == 0:
                code = gguf_repack_for_cpu(buffer.view(-1, buffer.shape[2]), qtype)
            setattr(layer, f"{name}_kernel_type", code)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        args = (x, layer.w13_qweight, layer.w13_qweight_kernel_type, layer.w2_qweight,
                layer.w2_qweight_kernel_type, topk_weights, topk_ids, layer.expert_map, layer.w13_bias,
                layer.w2_bias, layer.activation, layer.apply_router_weight_on_input)
        if torch.compiler.is_compiling():
            return torch.ops.minivllm.gguf_fused_experts(*args)
        return gguf_fused_experts(*args)


def _type_name(qtype: int) -> str:
    return gguf.GGMLQuantizationType(qtype).name


def gguf_fused_experts(x: torch.Tensor, w13: torch.Tensor, w13_type: int, w2: torch.Tensor,
                       w2_type: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       expert_map: torch.Tensor | None, w13_bias: torch.Tensor | None,
                       w2_bias: torch.Tensor | None, activation: str,
                       apply_router_weight_on_input: bool) -> torch.Tensor:
    """The routed experts on GGUF weights, x [T, H] -> [T, H] (see the module docstring)."""
    if w13_type in GGUF_FLOAT_TYPES and w2_type in GGUF_FLOAT_TYPES:    # plain expert tensors
        return fused_experts(x, w13, w2, topk_weights, topk_ids, activation=activation,
                             apply_router_weight_on_input=apply_router_weight_on_input,
                             expert_map=expert_map, w1_bias=w13_bias, w2_bias=w2_bias)
    if (activation == "silu" and w13_bias is None and w2_bias is None
            and not apply_router_weight_on_input and w13_type not in GGUF_FLOAT_TYPES
            and w2_type not in GGUF_FLOAT_TYPES):
        out = fused_experts_gguf(x, w13, w13_type, w2, w2_type, topk_weights, topk_ids,
                                 expert_map)
        if out is not None:
            return out

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        h = gguf_matmul(rows, w13[expert], w13_type,
                        None if w13_bias is None else w13_bias[expert])       # [n, 2I]
        return gguf_matmul(gated_activation(h, activation), w2[expert], w2_type,
                           None if w2_bias is None else w2_bias[expert])      # [n, H]

    return run_experts(x, topk_weights, topk_ids, expert_map, w13.shape[0], expert_mlp,
                       apply_router_weight_on_input)


# `torch.ops.minivllm.gguf_fused_experts`: compiled graphs call the experts opaquely (the
# per-step expert counts would otherwise break the graph).
register_op("gguf_fused_experts(Tensor x, Tensor w13, int w13_type, Tensor w2, int w2_type, "
            "Tensor topk_weights, Tensor topk_ids, Tensor? expert_map, Tensor? w13_bias, "
            "Tensor? w2_bias, str activation, bool apply_router_weight_on_input) -> Tensor",
            gguf_fused_experts, fused_experts_fake)
