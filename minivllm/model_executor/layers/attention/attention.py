"""`Attention`, called by model files as `attn(q, k, v)`; cache and metadata come from the context.

The layer registers itself under its prefix in `static_forward_context`. At run time it finds its
metadata and slot mapping in the forward context (set by the model runner), writes this step's K/V
into `self.kv_cache` (bound by the runner through `bind_kv_cache`) and runs the backend's impl.
"""

from typing import Any

import torch
import torch.nn as nn

from minivllm.config import CacheConfig, get_current_vllm_config
from minivllm.forward_context import get_forward_context
from minivllm.model_executor.kernels.op_library import register_op
from minivllm.model_executor.layers.attention.backends.cpu_attn import TorchAttentionBackend
from minivllm.v1.attention.backend import AttentionType

# fp8: keys / values stored rounded to fp8 with unit scales (vLLM's default without
# calibrated k_scale / v_scale), widened as they are read (csrc/paged_decode_attention.cpp).
_KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                    "float16": torch.float16, "fp8": torch.float8_e4m3fn,
                    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention: q [T, nH*d], k/v [T, nKV*d] -> [T, nH*d_v]."""

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 use_alibi_sqrt: bool | None = None, cache_config: CacheConfig | None = None,
                 quant_config: Any = None, logits_soft_cap: float | None = None,
                 per_layer_sliding_window: int | None = None, prefix: str = "",
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 mm_prefix_clamp_sliding_window: bool = False, attn_backend: Any = None,
                 head_size_v: int | None = None, **extra_impl_args: Any) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        assert num_heads % num_kv_heads == 0, (
            f"num_heads ({num_heads}) is not divisible by num_kv_heads ({num_kv_heads})")
        if per_layer_sliding_window is not None:
            sliding_window = per_layer_sliding_window
        elif cache_config is not None:
            sliding_window = cache_config.sliding_window
        else:
            sliding_window = None
        self.kv_cache_dtype = cache_config.cache_dtype if cache_config is not None else "auto"
        if getattr(quant_config, "kv_cache_scheme", None) is not None:
            raise NotImplementedError("a checkpoint's KV-cache scheme (calibrated k/v scales) is "
                                      "not supported on CPU; use a checkpoint without a "
                                      "kv_cache_scheme (kv_cache_dtype='fp8' keeps an fp8 cache "
                                      "with unit scales)")
        self.kv_cache_torch_dtype = _kv_cache_torch_dtype(self.kv_cache_dtype)

        self.layer_name = prefix
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.head_size_v = head_size_v or head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.has_sink = extra_impl_args.get("sinks") is not None
        self.use_mm_prefix = False
        self.mm_prefix_clamp_sliding_window = mm_prefix_clamp_sliding_window
        self.kv_cache_update_bypass = False
        self.use_direct_call = True

        self.attn_backend = attn_backend if attn_backend is not None else TorchAttentionBackend
        if self.head_size_v != head_size:
            extra_impl_args["head_size_v"] = self.head_size_v
        if use_alibi_sqrt is not None:
            extra_impl_args["use_alibi_sqrt"] = use_alibi_sqrt
        self.impl = self.attn_backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
            self.kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
            **extra_impl_args)

        self._register(prefix)
        self.kv_cache = torch.tensor([])
        self._init_kv_scales()

    def _register(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("Attention needs a non-empty, unique `prefix` (e.g. "
                             "'model.layers.0.self_attn.attn'): it is the layer's key in the "
                             "forward context")
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def _init_kv_scales(self) -> None:
        # KV-quant scales (contract 3.1.8): persistent fp32 buffers fixed at 1.0, no Parameters.
        for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            self.register_buffer(name, torch.tensor(1.0, dtype=torch.float32))
        self._q_scale_float = self._k_scale_float = self._v_scale_float = 1.0
        self._prob_scale_float = 1.0
        self._k_scale_cpu = self._v_scale_cpu = torch.tensor(1.0)
        self._o_scale_float = None

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                output_shape: torch.Size | tuple[int, ...] | None = None,
                output_dtype: torch.dtype | None = None) -> torch.Tensor:
        """q [T, nH*d], k/v [T, nKV*d] (or None) -> [T, nH*d_v]."""
        if torch.compiler.is_compiling():
            # Opaque to the compiler: one graph for the whole model, whatever the step's plan.
            return torch.ops.minivllm.unified_attention(query, key, value, self.layer_name)
        return self._forward_eager(query, key, value, output_shape, output_dtype)

    def _forward_eager(self, query: torch.Tensor, key: torch.Tensor | None,
                       value: torch.Tensor | None,
                       output_shape: torch.Size | tuple[int, ...] | None = None,
                       output_dtype: torch.dtype | None = None) -> torch.Tensor:
        ctx = get_forward_context()
        metadata = ctx.attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata[self.layer_name]
        elif isinstance(metadata, list):
            metadata = metadata[0][self.layer_name]
        num_tokens = query.shape[0]
        output_shape = output_shape or (num_tokens, self.num_heads * self.head_size_v)
        output_dtype = output_dtype or query.dtype
        if metadata is None:                                    # profiling / dummy run
            return torch.zeros(output_shape, dtype=output_dtype).view(num_tokens, -1)
        assert isinstance(ctx.slot_mapping, dict), "slot_mapping must be a dict layer -> tensor"
        if (self._writes_kv_cache and key is not None and value is not None
                and not getattr(self.attn_backend, "forward_includes_kv_cache_update", False)):
            slot_mapping = ctx.slot_mapping.get(self.layer_name)
            if slot_mapping is not None:
                self.impl.do_kv_cache_update(self, key, value, self.kv_cache, slot_mapping)
        output = torch.empty(output_shape, dtype=output_dtype)
        self.impl.forward(self, query, key, value, self.kv_cache, metadata, output=output)
        return output.view(num_tokens, self.num_heads * self.head_size_v)

    @property
    def _writes_kv_cache(self) -> bool:
        return (self.attn_type != AttentionType.ENCODER_ONLY
                and self.kv_sharing_target_layer_name is None)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Attach this layer's cache (shape `get_kv_cache_shape(...)`, contiguous)."""
        self.kv_cache = kv_cache
        forget = getattr(self.impl, "forget_kv_cache", None)
        if forget is not None:     # the backend's views of the previous cache go with it
            forget()

    def get_attn_backend(self) -> type:
        return self.attn_backend

    def get_kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The per-layer cache shape the backend expects for this layer's head geometry."""
        return self.attn_backend.get_kv_cache_shape(num_blocks, block_size, self.num_kv_heads,
                                                    self.head_size, self.kv_cache_dtype,
                                                    head_size_v=self.head_size_v)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """No KV-quant weights on CPU: keep the scales at 1.0."""
        for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            getattr(self, name).fill_(1.0)
        self.impl.process_weights_after_loading(act_dtype)

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, scale={self.scale}, "
                f"sliding_window={self.sliding_window}, backend={self.attn_backend.get_name()}")


def _kv_cache_torch_dtype(cache_dtype: str) -> torch.dtype:
    if cache_dtype == "auto":
        return torch.get_default_dtype()
    if cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {cache_dtype!r} is not supported on CPU; choose one of "
                         f"auto, {', '.join(_KV_CACHE_DTYPES)}")
    return _KV_CACHE_DTYPES[cache_dtype]


def unified_attention(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                      layer_name: str) -> torch.Tensor:
    """The layer named `layer_name` (from the forward context) on q/k/v; what compiled graphs call
    (as `torch.ops.minivllm.unified_attention`).

    NOTE: it writes the layer's KV cache, which the compiler never sees: the cache is not an
    argument, and the write is read back only by this same op in later steps.
    """
    layer = get_forward_context().no_compile_layers[layer_name]
    return layer._forward_eager(query, key, value)


def _unified_attention_fake(query: torch.Tensor, key: torch.Tensor | None,
                            value: torch.Tensor | None, layer_name: str) -> torch.Tensor:
    layer = get_forward_context().no_compile_layers[layer_name]
    return query.new_empty(query.shape[0], layer.num_heads * layer.head_size_v)


register_op("unified_attention(Tensor query, Tensor? key, Tensor? value, str layer_name) -> Tensor",
            unified_attention, _unified_attention_fake)
