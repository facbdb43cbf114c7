"""The CPU paged-attention backend: native kernels where they apply, else gather K/V blocks + SDPA.

Decode rows go to one call of the native paged decode kernel (`csrc/paged_decode_attention.cpp`,
K/V read in place through the block table); fresh bf16 prompts of more than 16 tokens to the AMX
prompt kernel (`csrc/prefill_attention_amx.cpp`); everything else (and everything when the
kernels are off) gathers its blocks and calls SDPA once per group.

KV cache layout (one contiguous tensor per layer): `[2, num_blocks, block_size, num_kv_heads, d]`
with `d = max(head_size, head_size_v)`; index 0 holds keys, 1 values. Gathering whole blocks along
dim 1 yields `[Bg, Lk, nKV, d]`, whose `transpose(1, 2)` is already the layout SDPA wants.
"""

import torch
import torch.nn.functional as F

from minivllm import _custom_ops as ops
from minivllm.forward_context import get_forward_context, is_forward_context_available
from minivllm.model_executor.kernels import attention as attn_ops
from minivllm.model_executor.layers.attention.backends.cpu_attn_metadata import (
    AttnGroup, DecodeBatch, TorchAttentionMetadata, TorchAttentionMetadataBuilder)
from minivllm.v1.attention.backend import AttentionBackend, AttentionType

_SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)


class TorchAttentionBackend(AttentionBackend):
    """Selects the CPU layout, metadata builder and implementation."""

    accept_output_buffer: bool = True
    # The impl writes the step's keys/values itself (from the forward context's slot mapping):
    # for a decode-only step the native kernel does it inside its own call.
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA_PAGED"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto",
                           head_size_v: int | None = None) -> tuple[int, ...]:
        head_dim = max(head_size, head_size_v or head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @staticmethod
    def get_impl_cls() -> type["TorchAttentionImpl"]:
        return TorchAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TorchAttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder

    @staticmethod
    def get_metadata_cls() -> type[TorchAttentionMetadata]:
        return TorchAttentionMetadata


class TorchAttentionImpl:
    """Writes K/V into the paged cache and attends with `F.scaled_dot_product_attention`."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | torch.Tensor | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, head_size_v: int | None = None,
                 use_alibi_sqrt: bool | None = None, **extra_impl_args: object) -> None:
        if attn_type not in _SUPPORTED_ATTN_TYPES:
            raise NotImplementedError(
                f"attn_type {attn_type!r} is not supported by the CPU backend; "
                f"supported: {[t.value for t in _SUPPORTED_ATTN_TYPES]}")
        if use_alibi_sqrt:
            raise NotImplementedError("use_alibi_sqrt is not supported by the CPU backend")
        if extra_impl_args.get("dual_chunk_attention_config") is not None:
            raise NotImplementedError("dual-chunk attention is not supported by the CPU backend")
        self.num_heads = num_heads
        self.head_size = head_size
        self.head_size_v = head_size_v or head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.alibi_slopes = (None if alibi_slopes is None
                             else torch.as_tensor(alibi_slopes, dtype=torch.float32))
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap or None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        # Attention sinks (gpt-oss): one learned logit per head [nH] joins each softmax's
        # denominator; the eager path adds it (SDPA and the native kernels have no such term).
        self.sinks: torch.Tensor | None = extra_impl_args.get("sinks")
        # Chunked-local attention (Llama 4's RoPE layers): a query attends only to keys in its
        # own block of `attention_chunk_size` positions; applied as a mask on every SDPA path.
        self.attention_chunk_size: int | None = extra_impl_args.get("attention_chunk_size")
        self._sdpa_ok = (self.logits_soft_cap is None and self.alibi_slopes is None
                         and self.sinks is None)
        # The native decode kernel covers plain softmax attention with one head size (a chunked
        # window, whose length varies with each query's position, is not one of its inputs).
        self._kernel_ok = (self._sdpa_ok and attn_type == AttentionType.DECODER
                           and not self.attention_chunk_size
                           and self.head_size == self.head_size_v
                           and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64)
        self._views: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Nothing to repack: the CPU path has no quantized KV."""

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter this step's keys/values ([T, nKV*d]) to their slots in the paged cache."""
        if kv_cache.numel() == 0:
            return                                              # no cache bound (profiling run)
        k_slots, v_slots, _, _ = self._cache_views(kv_cache)
        num = slot_mapping.shape[0]
        if key.shape[0] != num:                                 # padded batch: real rows only
            key, value = key[:num], value[:num]
        if key.dtype != kv_cache.dtype:
            key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        if k_slots.dim() == 3:                                  # head dims differ: per head
            key = key.view(num, self.num_kv_heads, self.head_size)
            value = value.view(num, self.num_kv_heads, self.head_size_v)
        # index_put_ rather than index_copy_: same cost for a few rows, 2x faster for prefills
        k_slots.index_put_((slot_mapping,), key)                # [T, nKV*d] rows into slots
        v_slots.index_put_((slot_mapping,), value)

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of this layer's cache, kept while the same tensor stays bound.

        (k_slots [NB*bs, nKV*d] (or [NB*bs, nKV, d] when d != cache head dim), v_slots,
        k_blocks [NB, bs*nKV*hd], v_blocks).
        NOTE: gathers run on the 2-D block views: `index_select` along dim 0 of a 2-D tensor is
        a row memcpy, several times faster than along dim 1 of the 5-D cache.
        """
        cached = self._views
        if cached is not None and cached[0] is kv_cache:
            return cached[1]
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        slots = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        blocks = kv_cache.view(2, num_blocks, block_size * num_kv_heads * head_dim)
        k_slots, v_slots = slots[0, ..., :self.head_size], slots[1, ..., :self.head_size_v]
        if head_dim == self.head_size == self.head_size_v:      # 2-D: no per-call reshapes
            k_slots, v_slots = k_slots.flatten(1), v_slots.flatten(1)
        views = (k_slots, v_slots, blocks[0], blocks[1])
        self._views = (kv_cache, views)
        return views

    def forget_kv_cache(self) -> None:
        """Drops the views of the cache last used (they keep its memory alive): the layer is
        being given another cache, or none (sleep mode)."""
        self._views = None

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: TorchAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of `query` ([T, nH*d]) into `output` ([T, nH*d_v]); returns `output`."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on CPU")
        if attn_metadata is None:
            return output.zero_()                               # profiling / dummy run
        q = query.view(-1, self.num_heads, self.head_size)      # [T, nH, d]
        out = output.view(-1, self.num_heads, self.head_size_v)  # [T, nH, d_v]
        if out.shape[0] > attn_metadata.num_actual_tokens:
            out[attn_metadata.num_actual_tokens:].zero_()       # padding rows
        use_kernel = attn_metadata.decode is not None and self._use_kernel(q, kv_cache, out)
        new_kv = self._write_kv(layer, key, value, kv_cache, attn_metadata, use_kernel)
        if self.attn_type == AttentionType.ENCODER_ONLY:
            groups = attn_metadata.encoder_groups
        elif use_kernel:
            self._attend_decode_kernel(attn_metadata.decode, q, kv_cache, out, new_kv)
            groups = attn_metadata.prefill_groups
        else:
            groups = attn_metadata.groups
        # NOTE: a loop over groups: a few decode buckets, plus one group per prefill (see
        # `_prefill_groups` for why prefills are not padded together).
        for g in groups:
            if g.q_len == 1 and not g.kv_from_input and self._sdpa_ok:
                self._attend_decode(g, q, kv_cache, attn_metadata, out)
                continue
            if self._attend_prompt_kernel(g, q, key, value, out):
                continue
            o = self._attend_group(g, q, key, value, kv_cache, attn_metadata)  # [Bg, Lq, nH, d_v]
            g.store_output(o, out)
        return output

    def _write_kv(self, layer: torch.nn.Module, key: torch.Tensor | None,
                  value: torch.Tensor | None, kv_cache: torch.Tensor,
                  md: TorchAttentionMetadata, use_kernel: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Writes this step's keys/values to the cache (as the layer would through
        `do_kv_cache_update`: the slot mapping of the forward context, skipped for encoder-only
        and KV-sharing layers), or returns (key, value, slots) for the decode kernel to write
        when every row of the step is one of its decode rows."""
        if (key is None or value is None or kv_cache.numel() == 0
                or self.attn_type == AttentionType.ENCODER_ONLY
                or self.kv_sharing_target_layer_name is not None
                or not is_forward_context_available()):
            return None
        slot_mapping = get_forward_context().slot_mapping
        slots = slot_mapping.get(layer.layer_name) if isinstance(slot_mapping, dict) else None
        if slots is None:
            return None
        width = self.num_kv_heads * self.head_size
        # (an fp8 cache takes bf16 rows: the kernel rounds them)
        if (use_kernel and not md.prefill_groups and key.dtype == value.dtype
                and attn_ops.attention_supports(kv_cache.dtype, key.dtype)
                and slots.dtype == torch.int64 and slots.is_contiguous()
                and key.shape[-1] == value.shape[-1] == width and key.dim() == value.dim() == 2
                and key.stride(1) == value.stride(1) == 1):
            return key, value, slots
        self.do_kv_cache_update(layer, key, value, kv_cache, slots)
        return None

    def _use_kernel(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> bool:
        """Decode rows go to the native kernel when it is built and supports these tensors
        (q [T, nH, d] and out [T, nH, d] with contiguous rows; an fp8 cache with bf16 q)."""
        return (self._kernel_ok and q.dtype == out.dtype
                and attn_ops.attention_supports(kv_cache.dtype, q.dtype)
                and kv_cache.is_contiguous()
                and kv_cache.shape[-1] == self.head_size and q.stride(2) == 1
                and q.stride(1) == self.head_size and out.is_contiguous()
                and ops.native_available())

    def _attend_decode_kernel(self, decode: DecodeBatch, q: torch.Tensor, kv_cache: torch.Tensor,
                              out: torch.Tensor,
                              new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                              ) -> None:
        """All decode rows in one call: keys/values read in place from the paged cache (after
        the kernel wrote `new_kv`'s rows into it, when given)."""
        attn_ops.paged_decode_attention(
            q.flatten(1), kv_cache, decode.block_table, decode.seq_lens, decode.rows,
            out.flatten(1), self.num_heads, self.num_kv_heads, self.head_size,
            self.sliding_window or 0, self.scale, new_kv)

    def _attend_prompt_kernel(self, g: AttnGroup, q: torch.Tensor, key: torch.Tensor | None,
                              value: torch.Tensor | None, out: torch.Tensor) -> bool:
        """A fresh prompt (no cached context, its rows consecutive) through the native AMX
        kernel, which reads q/k/v in place; False when it cannot take it (then SDPA runs)."""
        if not (self._kernel_ok and g.kv_from_input and g.num_seqs == 1
                and g.row_start is not None and g.causal and not g.needs_mask
                and g.q_len == g.k_len_max and key is not None and value is not None
                and (self.sliding_window is None or self.sliding_window >= g.q_len)
                and q.dtype == key.dtype == value.dtype == out.dtype
                and attn_ops.prefill_attention_supported(q.dtype, self.head_size)):
            return False
        rows = slice(g.row_start, g.row_start + g.q_len)
        k2 = key.view(-1, self.num_kv_heads * self.head_size)[rows]
        v2 = value.view(-1, self.num_kv_heads * self.head_size)[rows]
        q2, o2 = q.flatten(1)[rows], out.flatten(1)[rows]       # [L, nH*d] views
        if not (q2.stride(1) == k2.stride(1) == v2.stride(1) == o2.stride(1) == 1):
            return False
        attn_ops.prefill_attention_bf16(q2, k2, v2, o2, self.num_heads, self.num_kv_heads,
                                   self.head_size, self.scale)
        return True

    def _attend_decode(self, g: AttnGroup, q: torch.Tensor, kv_cache: torch.Tensor,
                       md: TorchAttentionMetadata, out: torch.Tensor) -> None:
        """One query per sequence: the fewest ops (each costs ~10 us when caches are cold
        after a GEMM, which is what bounds batch-1 decode)."""
        n = g.num_seqs
        # [n, nH*d] rows viewed as [n, nH, 1, d]: with one query per sequence this is already
        # the [B, heads, Lq, d] layout SDPA wants, without a transpose.
        qg = g.select_rows(q).view(n, self.num_heads, 1, self.head_size)
        k, v = self._gather_kv(g, kv_cache, md)                 # [n, nKV, Lk, d]
        if k.dtype != qg.dtype:
            k, v = k.to(qg.dtype), v.to(qg.dtype)
        mask = g.mask(self.sliding_window, qg.dtype, self.attention_chunk_size)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale,
                                           enable_gqa=self.num_queries_per_kv > 1)
        o = o.view(n, self.num_heads, self.head_size_v)         # Lq = 1: [n, nH, 1, d_v] rows
        if g.row_start is not None:
            out[g.row_start:g.row_start + n].copy_(o)
        else:
            out.index_copy_(0, g.out_rows, o.to(out.dtype))

    def _attend_group(self, g: AttnGroup, q: torch.Tensor, key: torch.Tensor | None,
                      value: torch.Tensor | None, kv_cache: torch.Tensor,
                      md: TorchAttentionMetadata) -> torch.Tensor:
        """SDPA over one group; returns [Bg, Lq, nH, d_v] (a strided view)."""
        qg = g.select_rows(q).view(g.num_seqs, g.q_len, self.num_heads, -1).transpose(1, 2)
        if g.kv_from_input and key is not None and value is not None:
            k = g.select_rows(key.view(-1, self.num_kv_heads, self.head_size))
            v = g.select_rows(value.view(-1, self.num_kv_heads, self.head_size_v))
            k = k.view(g.num_seqs, g.q_len, self.num_kv_heads, -1).transpose(1, 2)
            v = v.view(g.num_seqs, g.q_len, self.num_kv_heads, -1).transpose(1, 2)
        else:
            k, v = self._gather_kv(g, kv_cache, md)             # [Bg, nKV, Lk, d], [.., d_v]
            if k.dtype != qg.dtype:
                k, v = k.to(qg.dtype), v.to(qg.dtype)
        if not self._sdpa_ok:
            o = self._attend_eager(g, qg, k, v)
        else:
            mask = g.mask(self.sliding_window, qg.dtype, self.attention_chunk_size)
            o = F.scaled_dot_product_attention(
                qg, k, v, attn_mask=mask, is_causal=g.use_is_causal and mask is None,
                scale=self.scale, enable_gqa=self.num_queries_per_kv > 1)
        return o.transpose(1, 2)

    def _gather_kv(self, g: AttnGroup, kv_cache: torch.Tensor,
                   md: TorchAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the group's blocks into the shared workspace; returns SDPA views of it."""
        if g.block_ids is None or kv_cache.numel() == 0:
            raise ValueError(f"layer needs a bound KV cache and a block table (attn_type="
                             f"{self.attn_type}); bind one with `bind_kv_cache` first")
        if g.block_start is not None:
            # One sequence on consecutive blocks: its first k_len_max slots of K and of V,
            # viewed straight out of the contiguous cache as [1, nKV, Lk, d] (one op each).
            _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
            size = (1, num_kv_heads, g.k_len_max)
            stride = (0, head_dim, num_kv_heads * head_dim, 1)
            start = kv_cache.storage_offset() + g.block_start * block_size * num_kv_heads * head_dim
            v_start = start + num_blocks * block_size * num_kv_heads * head_dim
            return (kv_cache.as_strided(size + (self.head_size,), stride, start),
                    kv_cache.as_strided(size + (self.head_size_v,), stride, v_start))
        _, _, k_blocks, v_blocks = self._cache_views(kv_cache)
        k_rows, v_rows, k, v = g.gather_targets(md.workspace, kv_cache, self.head_size,
                                                self.head_size_v)
        torch.index_select(k_blocks, 0, g.block_ids, out=k_rows)
        torch.index_select(v_blocks, 0, g.block_ids, out=v_rows)
        return k, v

    def _attend_eager(self, g: AttnGroup, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> torch.Tensor:
        """Reference-style attention for what SDPA cannot express (soft cap, ALiBi, sinks),
        in fp32."""
        k = k.repeat_interleave(self.num_queries_per_kv, dim=1).float()  # [Bg, nH, Lk, d]
        v = v.repeat_interleave(self.num_queries_per_kv, dim=1).float()
        scores = torch.matmul(q.float(), k.transpose(-1, -2)) * self.scale  # [Bg, nH, Lq, Lk]
        if self.logits_soft_cap is not None:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        if self.alibi_slopes is not None:
            dist = torch.arange(g.k_len_max) - g.q_pos[:, :, None]      # [Bg, Lq, Lk]
            scores = scores + self.alibi_slopes[None, :, None, None] * dist[:, None].float()
        allowed = g.build_mask(self.sliding_window, self.attention_chunk_size)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if self.sinks is not None:        # an extra column per head, dropped after the softmax
            sink = self.sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
            return torch.matmul(probs, v).to(q.dtype)
        return torch.matmul(scores.softmax(dim=-1), v).to(q.dtype)
