"""vLLM's home of the weight loaders (they live in `parameter.py`), `get_quant_config`, the
checkpoint-name remappers (`maybe_remap_kv_scale_name`, `remap_moe_expert_weights`) and
attention sinks (`make_attention_sink`)."""

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from minivllm.config import LoadConfig, ModelConfig
from minivllm.distributed import (get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)
from minivllm.logger import init_logger
from minivllm.model_executor.layers.quantization import (QuantizationConfig,
                                                         get_quantization_config)
from minivllm.model_executor.parameter import (LoaderFunction, composed_weight_loader,
                                               default_weight_loader, row_parallel_weight_loader,
                                               sharded_weight_loader)

__all__ = ["LoaderFunction", "composed_weight_loader", "default_weight_loader", "get_quant_config",
           "load_attention_sink", "make_attention_sink", "maybe_remap_kv_scale_name",
           "maybe_remap_moe_expert_param_name", "remap_moe_expert_weights",
           "row_parallel_weight_loader", "sharded_weight_loader"]

logger = init_logger(__name__)

# `.self_attn.k_proj.k_scale` (ModelOpt), `.self_attn.qkv_proj.v_scale` (after stacking) and
# a bare `.self_attn.k_scale` all belong to the attention layer: `.self_attn.attn.k_scale`.
_PROJ_SCALE = re.compile(r"\.(?:[kv]_proj|qkv_proj)(\.[kv]_scale)$")


def get_quant_config(model_config: ModelConfig, load_config: LoadConfig,
                     device: str = "cpu") -> QuantizationConfig | None:
    """The QuantizationConfig the model's layers get (None: unquantized).

    Read from, in order: the GGUF file (types per tensor, nothing to parse here), config.json's
    `quantization_config`, a method-specific file in the checkpoint folder
    (`get_config_filenames`, e.g. `quantize_config.json`); otherwise the method quantizes an
    unquantized checkpoint online (`from_config({})`; methods that cannot raise). Then the method
    checks it can run on `device` with the model's activation dtype.
    """
    if model_config.quantization is None:
        return None
    quant_cls = get_quantization_config(model_config.quantization)
    if model_config.is_gguf:
        quant_config = quant_cls.from_config({})
    else:
        quant_config = quant_cls.from_config(_checkpoint_quant_dict(model_config, quant_cls))
    quant_config.verify_runtime(device, model_config.dtype)
    return quant_config


def _checkpoint_quant_dict(model_config: ModelConfig,
                           quant_cls: type[QuantizationConfig]) -> dict[str, Any]:
    hf_quant = getattr(model_config.hf_config, "quantization_config", None)
    if hf_quant is not None:
        return dict(hf_quant) if isinstance(hf_quant, dict) else hf_quant.to_dict()
    folder = model_config.model
    for name in quant_cls.get_config_filenames():
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    return {}   # an unquantized checkpoint: online quantization


def maybe_remap_kv_scale_name(name: str, params_dict: Mapping[str, Any]) -> str | None:
    """A checkpoint's KV-cache scale name as the attention layer's parameter name, or None (with
    a warning) when the model has no such parameter; any other name comes back unchanged.

    `.kv_scale` (the deprecated single scale) becomes `.attn.k_scale`; `.k_scale` / `.v_scale`
    move from the projection (`k_proj`, `v_proj`, `qkv_proj`) or the attention block to `.attn`.
    """
    if name.endswith(".kv_scale"):
        remapped = name.removesuffix(".kv_scale") + ".attn.k_scale"
    elif name.endswith((".k_scale", ".v_scale")):
        remapped = _PROJ_SCALE.sub(r".attn\1", name)
        if remapped == name and not name.endswith((".attn.k_scale", ".attn.v_scale")):
            remapped = name[:-len(".k_scale")] + ".attn" + name[-len(".k_scale"):]
    else:
        return name
    if remapped not in params_dict:
        logger.warning("Found KV-cache scale %s in the checkpoint, but the model has no "
                       "parameter %s; the scale is not loaded.", name, remapped)
        return None
    return remapped


def maybe_remap_moe_expert_param_name(name: str, params_dict: Mapping[str, Any]) -> str:
    """`...experts.w13_weight` as `...experts.routed_experts.w13_weight` when the model's MoE
    layers are `MoERunner`s (their weights sit one level down); any other name unchanged."""
    if ".experts." not in name or name in params_dict:
        return name
    head, _, tail = name.partition(".experts.")
    for between in ("routed_experts.", "base_layer.routed_experts."):
        candidate = f"{head}.experts.{between}{tail}"
        if candidate in params_dict:
            return candidate
    return name


def remap_moe_expert_weights(weights: Iterable[tuple[str, torch.Tensor]],
                             params_dict: Mapping[str, Any]
                             ) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with `maybe_remap_moe_expert_param_name` applied to every name."""
    for name, weight in weights:
        yield maybe_remap_moe_expert_param_name(name, params_dict), weight


def load_attention_sink(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """This TP rank's heads of a sink [heads]; a parameter padded past them keeps -inf there
    (a padded head then adds nothing to any softmax denominator)."""
    tp_size = get_tensor_model_parallel_world_size()
    heads = loaded_weight.numel()
    if heads % tp_size:
        raise ValueError(f"attention sink heads ({heads}) must be divisible by the tensor "
                         f"parallel size ({tp_size})")
    local = heads // tp_size
    start = get_tensor_model_parallel_rank() * local
    default_weight_loader(param[:local], loaded_weight.narrow(0, start, local))
    param.data[local:].fill_(-float("inf"))


def make_attention_sink(num_heads: int, dtype: torch.dtype | None = None) -> torch.nn.Parameter:
    """A sink logit per local head [num_heads], -inf until loaded, with its TP loader."""
    sink = torch.nn.Parameter(torch.full((num_heads,), -float("inf"), dtype=dtype),
                              requires_grad=False)
    sink.weight_loader = load_attention_sink
    return sink
