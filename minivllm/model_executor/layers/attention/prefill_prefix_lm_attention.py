"""`PrefillPrefixLMAttention` (vLLM's prefix-LM decoder layer, HRM-Text): a prompt's tokens attend
to each other bidirectionally in the step that prefills it; later tokens attend causally.

vLLM runs the layer with `causal=False` on every step. For a one-token decode that is the causal
result (the new query sees every cached key and nothing sees it back), so only a prefill differs.
A prefill is bidirectional over the tokens of its own step only, so a prompt split over steps
(chunked prefill) or started from cached blocks (prefix caching) would attend differently. vLLM
turns both off for such models (its KV cache spec says `non_causal`); minivllm's engine turns off
prefix caching and schedules every prefill whole (`Scheduler(whole_prefills=True)`) when its
model has such a layer, and the layer refuses, with a clear error, any step where a multi-token
prefill continues from cached tokens.

NOTE: as in vLLM, a request preempted and recomputed prefills prompt and output in one step,
bidirectionally over both.
"""

from dataclasses import replace
from typing import Any

import torch

from minivllm.config import CacheConfig, get_current_vllm_config
from minivllm.model_executor.layers.attention.attention import Attention
from minivllm.model_executor.layers.attention.backends.cpu_attn import (TorchAttentionBackend,
                                                                        TorchAttentionImpl)
from minivllm.model_executor.layers.attention.backends.cpu_attn_metadata import (
    TorchAttentionMetadata)
from minivllm.v1.attention.backend import AttentionType

__all__ = ["PrefillPrefixLMAttention", "PrefixLMAttentionBackend"]


class PrefixLMAttentionImpl(TorchAttentionImpl):
    """The CPU impl with every prefill group bidirectional (decode rows stay on the causal paths,
    which give the same result for one query)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (the step's metadata, its prefix-LM copy): the copy is made once per step and layer.
        self._step: tuple[TorchAttentionMetadata, TorchAttentionMetadata] | None = None

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: TorchAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if attn_metadata is not None and attn_metadata.prefill_groups:
            attn_metadata = self._prefix_lm_metadata(attn_metadata, layer)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def _prefix_lm_metadata(self, md: TorchAttentionMetadata,
                            layer: torch.nn.Module) -> TorchAttentionMetadata:
        """`md` with its prefill groups non-causal; each must be whole prompts (no cached keys)."""
        if self._step is not None and self._step[0] is md:
            return self._step[1]
        if not all(g.kv_from_input for g in md.prefill_groups):
            raise NotImplementedError(
                f"{layer.layer_name}: PrefillPrefixLMAttention attends a prompt bidirectionally "
                "within one step, so a prefill of several tokens cannot continue from cached "
                "tokens (a chunked prefill or a prefix-cache hit), as vLLM refuses too. Serve "
                "this model with enable_prefix_caching=False and a max_num_batched_tokens of at "
                "least max_model_len on one process (TP = PP = 1), where the engine schedules "
                "every prefill whole.")
        # Keys are the step's own rows: the mask only hides padding (built afresh, non-causal).
        groups = [replace(g, causal=False, masks={}) for g in md.prefill_groups]
        prefix_lm = replace(md, causal=False, prefill_groups=groups)
        self._step = (md, prefix_lm)
        return prefix_lm


class PrefixLMAttentionBackend(TorchAttentionBackend):
    """The CPU paged backend whose prefills attend bidirectionally."""

    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA_PAGED_PREFIX_LM"

    @staticmethod
    def get_impl_cls() -> type[PrefixLMAttentionImpl]:
        return PrefixLMAttentionImpl


class PrefillPrefixLMAttention(Attention):
    """Decoder attention (with a KV cache) that runs non-causally: bidirectional within each
    prefill, causal for decodes. q [T, nH*d], k/v [T, nKV*d] -> [T, nH*d]."""

    # Read by the engine: prefix caching off and whole prefills (vLLM: `non_causal` KV specs).
    non_causal = True

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 cache_config: CacheConfig | None = None, attn_type: str | None = None,
                 **kwargs: Any) -> None:
        if attn_type is not None and attn_type != AttentionType.DECODER:
            raise ValueError(f"PrefillPrefixLMAttention only supports attn_type="
                             f"{AttentionType.DECODER.value!r}, got {attn_type!r}")
        if kwargs.get("attn_backend") is not None:
            raise ValueError("PrefillPrefixLMAttention picks its own backend (attn_backend must "
                             "be None)")
        kwargs.pop("attn_backend", None)
        _check_engine(cache_config)
        super().__init__(num_heads, head_size, scale, cache_config=cache_config,
                         attn_type=AttentionType.DECODER, attn_backend=PrefixLMAttentionBackend,
                         **kwargs)


def _check_engine(cache_config: CacheConfig | None) -> None:
    """Worker processes (TP or PP > 1) cannot tell the engine to turn prefix caching off, and a
    whole-prompt cache hit would run the prompt's last token as a causal decode: refuse it."""
    parallel = get_current_vllm_config().parallel_config
    if (cache_config is not None and cache_config.enable_prefix_caching
            and parallel.world_size > 1):
        raise ValueError("PrefillPrefixLMAttention (prefix-LM attention) with TP or PP > 1 "
                         "needs enable_prefix_caching=False: a cached prompt prefix would skip "
                         "its bidirectional prefill")
