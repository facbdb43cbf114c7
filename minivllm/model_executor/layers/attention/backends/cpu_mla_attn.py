"""The CPU backend of multi-head latent attention (MLA, DeepSeek-V2/V3): one latent row per token.

The paged cache holds, per token, the normalised KV latent `c_kv` [L] and the shared rotated key
`k_pe` [R] side by side: `[num_blocks, block_size, L + R]` (576 values for DeepSeek, instead of
nH * (192 + 128) for the decompressed keys and values). Per head, keys are
`[c_kv @ W_UK[h], k_pe]` and values `c_kv @ W_UV[h]`, with `kv_b_proj.weight` viewed as
`[nH, Dn + Dv, L]` (`W_UK` its first Dn rows per head, `W_UV` the last Dv).

Two ways to attend, chosen per group as vLLM's MLA backends do:
- decode rows (one query each) absorb `W_UK` into the query (`q_nope @ W_UK` -> [nH, L]) and attend
  the latent rows directly, all heads as the query rows of one single-KV-head SDPA call, then
  map the latent output through `W_UV`. Nothing per key is decompressed.
- prompt chunks decompress their keys' latents (one `F.linear` over the chunk's keys) and run
  ordinary multi-head SDPA with head size Dn + R, value size Dv: fewer FLOPs than the absorbed
  form once a query row meets many keys.
"""

import torch
import torch.nn.functional as F

from minivllm.forward_context import get_forward_context, is_forward_context_available
from minivllm.model_executor.layers.attention.backends.cpu_attn_metadata import (
    AttnGroup, TorchAttentionMetadata, TorchAttentionMetadataBuilder)
from minivllm.v1.attention.backend import AttentionBackend, AttentionType


class CPUMLABackend(AttentionBackend):
    """Cache layout, metadata builder (the dense backend's: one plan per step serves both) and
    implementation of MLA on CPU."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True     # the impl writes each step's latent rows

    @staticmethod
    def get_name() -> str:
        return "CPU_MLA"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto",
                           head_size_v: int | None = None) -> tuple[int, ...]:
        assert num_kv_heads == 1, "MLA caches one latent row per token"
        return (num_blocks, block_size, head_size)

    @staticmethod
    def get_impl_cls() -> type["CPUMLAImpl"]:
        return CPUMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TorchAttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder


class CPUMLAImpl:
    """MLA on the paged latent cache; the layer gives kv_b_proj's weight (`kv_b_weight`)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, *, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 **unused: object) -> None:
        unsupported = {"attn_type": attn_type != AttentionType.DECODER,
                       "alibi_slopes": alibi_slopes is not None,
                       "sliding_window": sliding_window is not None,
                       "logits_soft_cap": bool(logits_soft_cap),
                       "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None}
        bad = [name for name, is_set in unsupported.items() if is_set]
        if bad:
            raise NotImplementedError(f"the CPU MLA backend supports causal decoder attention "
                                      f"only; unsupported arguments: {', '.join(bad)}")
        assert head_size == kv_lora_rank + qk_rope_head_dim and num_kv_heads == 1
        self.num_heads, self.scale = num_heads, float(scale)
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, qk_rope_head_dim
        self.nope_dim, self.v_dim = qk_nope_head_dim, v_head_dim
        self.head_size = head_size                          # L + R, the cache row

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Nothing to prepare: the layer hands over kv_b_proj's weight at every call."""

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor,
                attn_metadata: TorchAttentionMetadata | None, output: torch.Tensor,
                **unused: object) -> torch.Tensor:
        """query [T, nH*(Dn+R)], key the latent rows [T, L+R] -> output [T, nH*Dv]."""
        if attn_metadata is None:
            return output.zero_()                               # profiling / dummy run
        # kv_b_proj's weight [nH*(Dn+Dv), L], read each call (the loader may move parameters).
        w_kv = layer.kv_b_weight(query.dtype)
        q = query.view(-1, self.num_heads, self.nope_dim + self.rope_dim)   # [T, nH, Dn+R]
        out = output.view(-1, self.num_heads, self.v_dim)                   # [T, nH, Dv]
        if out.shape[0] > attn_metadata.num_actual_tokens:
            out[attn_metadata.num_actual_tokens:].zero_()       # padding rows
        self._write_latent(layer, key, kv_cache)
        # NOTE: a loop over groups (a few decode buckets, one group per long prefill).
        for g in attn_metadata.decode_groups:
            g.store_output(self._attend_absorbed(g, q, w_kv, kv_cache, attn_metadata), out)
        for g in attn_metadata.prefill_groups:
            g.store_output(self._attend_decompressed(g, q, key, w_kv, kv_cache, attn_metadata),
                           out)
        return output

    def _write_latent(self, layer: torch.nn.Module, key: torch.Tensor | None,
                      kv_cache: torch.Tensor) -> None:
        if key is None or kv_cache.numel() == 0 or not is_forward_context_available():
            return
        slot_mapping = get_forward_context().slot_mapping
        slots = slot_mapping.get(layer.layer_name) if isinstance(slot_mapping, dict) else None
        if slots is None:
            return
        rows = key[:slots.shape[0]]                             # padded batch: real rows only
        kv_cache.view(-1, self.head_size).index_put_((slots,), rows.to(kv_cache.dtype))

    def _latents(self, g: AttnGroup, kv_cache: torch.Tensor,
                 md: TorchAttentionMetadata) -> torch.Tensor:
        """The group's cached latent rows [Bg, Lk, L+R] (a view for one consecutive run)."""
        if g.block_ids is None or kv_cache.numel() == 0:
            raise ValueError("MLA needs a bound KV cache and a block table; bind one with "
                             "`bind_kv_cache` first")
        num_blocks, block_size, width = kv_cache.shape
        if g.block_start is not None:
            start = g.block_start * block_size
            return kv_cache.view(-1, width)[start:start + g.k_len_max].unsqueeze(0)
        rows = md.workspace.get((g.block_ids.numel(), block_size * width), kv_cache.dtype)
        torch.index_select(kv_cache.view(num_blocks, -1), 0, g.block_ids, out=rows)
        return rows.view(g.num_seqs, -1, width)[:, :g.k_len_max]

    def _attend_absorbed(self, g: AttnGroup, q: torch.Tensor, w_kv: torch.Tensor,
                         kv_cache: torch.Tensor, md: TorchAttentionMetadata) -> torch.Tensor:
        """One query per sequence; returns [Bg, 1, nH, Dv]."""
        n, dtype = g.num_seqs, q.dtype
        per_head = w_kv.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        qg = g.select_rows(q)                                   # [n, nH, Dn+R]
        # q_nope [nH, n, Dn] @ W_UK [nH, Dn, L] -> the query in latent space [nH, n, L].
        # NOTE: matmul, not bmm: bmm copies the strided W_UK slice first (1.4x slower here).
        q_lat = torch.matmul(qg[..., :self.nope_dim].transpose(0, 1), per_head[:, :self.nope_dim])
        q_full = torch.cat((q_lat.transpose(0, 1), qg[..., self.nope_dim:]), dim=-1)
        lat = self._latents(g, kv_cache, md).to(dtype).unsqueeze(1)          # [n, 1, Lk, L+R]
        # Heads as the query rows of one KV head: [n, 1, nH, L+R] x [n, 1, Lk, L+R].
        mask = g.mask(None, dtype)                              # [n, 1, 1, Lk] or None
        o_lat = F.scaled_dot_product_attention(q_full.unsqueeze(1), lat,
                                               lat[..., :self.kv_lora_rank], attn_mask=mask,
                                               scale=self.scale)          # [n, 1, nH, L]
        # o_lat [nH, n, L] @ W_UV^T [nH, L, Dv], as the last Dv columns of o_lat @ W_h^T with
        # the whole per-head block W_h [nH, Dn+Dv, L]: its transposed view needs no copy, where
        # the W_UV slice's would (4x slower for DeepSeek-V2-Lite's shapes).
        o = torch.bmm(o_lat.view(n, self.num_heads, -1).transpose(0, 1),
                      per_head.transpose(1, 2))[..., self.nope_dim:]
        return o.transpose(0, 1).unsqueeze(1)                   # [n, 1, nH, Dv]

    def _attend_decompressed(self, g: AttnGroup, q: torch.Tensor, key: torch.Tensor | None,
                             w_kv: torch.Tensor, kv_cache: torch.Tensor,
                             md: TorchAttentionMetadata) -> torch.Tensor:
        """Prompt chunks; returns [Bg, Lq, nH, Dv]."""
        bg, dtype = g.num_seqs, q.dtype
        qg = g.select_rows(q).view(bg, g.q_len, self.num_heads, -1).transpose(1, 2)
        # qg [Bg, nH, Lq, Dn+R]
        if g.kv_from_input and key is not None:
            lat = g.select_rows(key).view(bg, g.q_len, -1)      # [Bg, Lk, L+R]
        else:
            lat = self._latents(g, kv_cache, md)
        lat = lat.to(dtype)
        lk = lat.shape[1]
        kv = F.linear(lat[..., :self.kv_lora_rank], w_kv)      # [Bg, Lk, nH*(Dn+Dv)]
        kv = kv.view(bg, lk, self.num_heads, self.nope_dim + self.v_dim)
        k_pe = lat[..., self.kv_lora_rank:].unsqueeze(2).expand(bg, lk, self.num_heads, -1)
        k = torch.cat((kv[..., :self.nope_dim], k_pe), dim=-1).transpose(1, 2)  # [Bg,nH,Lk,Dq]
        v = kv[..., self.nope_dim:].transpose(1, 2)                               # [Bg,nH,Lk,Dv]
        mask = g.mask(None, dtype)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask,
                                           is_causal=g.use_is_causal and mask is None,
                                           scale=self.scale)
        return o.transpose(1, 2)                                # [Bg, Lq, nH, Dv]
