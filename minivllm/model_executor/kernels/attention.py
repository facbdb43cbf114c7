"""The attention kernels of `csrc/` as CPU attention backends call them: the paged decode kernel
(`csrc/paged_decode_attention.cpp`: one query per sequence, K/V read in place through the block
table; bf16, fp32 or fp8 caches) and the AMX prompt kernel (`csrc/prefill_attention_amx.cpp`).
The library itself is `_custom_ops`' (built on first use; its functions are looked up at each
call, so a CPU graph's recorders see them)."""

import functools

import torch

from minivllm import _custom_ops as ops

_ATTN_FUNCS = {torch.bfloat16: "minivllm_paged_decode_bf16",
               torch.float32: "minivllm_paged_decode_f32"}
# fp8 caches (kv_cache_dtype "fp8" / "fp8_e5m2"), bf16 queries: minivllm_paged_decode_bf16_fp8's
# format argument.
_FP8_CACHE_FORMATS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}


def attention_supports(dtype: torch.dtype, query_dtype: torch.dtype | None = None) -> bool:
    """Whether `paged_decode_attention` reads a cache of `dtype` for queries of `query_dtype`
    (default: the cache's): the same dtype, or bf16 queries over an fp8 cache."""
    query_dtype = query_dtype or dtype
    if dtype in _FP8_CACHE_FORMATS:
        return query_dtype == torch.bfloat16
    return dtype in _ATTN_FUNCS and query_dtype == dtype


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                           num_heads: int, num_kv_heads: int, head_size: int, window: int,
                           scale: float,
                           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                           ) -> None:
    """out[rows] = attention of query[rows] over each sequence's cached keys, in place.

    query/out: [T, >= nH*d] with unit stride inside a row; kv_cache: contiguous
    [2, num_blocks, block_size, nKV, d]; block_table: int32 [B, max_blocks] (contiguous rows);
    seq_lens: int32 [B]; rows: int64 [B] (query row of each sequence); window: 0 = unlimited.
    new_kv: (key, value, slot_mapping): key/value [T, nKV*d] in the cache's dtype (unit stride
    inside a row), slot_mapping int64 [>= max(rows) + 1]; each sequence's new row is written to
    its slot first (else the caller has written the cache).
    """
    lib = ops._lib
    assert lib is not None, "call native_available() first"
    _, num_blocks, block_size, _, head_dim = kv_cache.shape
    v_offset = num_blocks * block_size * num_kv_heads * head_dim * kv_cache.element_size()
    k_new = v_new = slots = None
    k_stride = v_stride = 0
    if new_kv is not None:
        key, value, slot_mapping = new_kv
        k_new, v_new, slots = key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr()
        k_stride, v_stride = key.stride(0), value.stride(0)
    fp8 = _FP8_CACHE_FORMATS.get(kv_cache.dtype)
    kernel = (getattr(lib, _ATTN_FUNCS[kv_cache.dtype]) if fp8 is None
              else functools.partial(lib.minivllm_paged_decode_bf16_fp8, fp8))
    rc = kernel(
        query.data_ptr(), query.stride(0), kv_cache.data_ptr(), kv_cache.data_ptr() + v_offset,
        num_kv_heads * head_dim, block_table.data_ptr(), block_table.stride(0),
        seq_lens.data_ptr(), rows.data_ptr(), out.data_ptr(), out.stride(0), rows.shape[0],
        num_heads, num_kv_heads, head_size, block_size, window, scale, torch.get_num_threads(),
        k_new, k_stride, v_new, v_stride, slots)
    if rc != 0:
        raise ValueError(f"paged decode kernel rejected num_heads={num_heads}, "
                         f"num_kv_heads={num_kv_heads}: heads per KV head must divide and be <= 64")


def prefill_attention_supported(dtype: torch.dtype, head_size: int) -> bool:
    """True when `prefill_attention_bf16` takes a layer: bf16, d = 64 or 128, AMX usable."""
    return (dtype == torch.bfloat16 and head_size in (64, 128) and ops.native_available()
            and ops._has_amx)


def prefill_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           num_heads: int, num_kv_heads: int, head_size: int,
                           scale: float) -> None:
    """Causal attention of one fresh prompt over its own keys, into `out` in place.

    q / out: [L, num_heads * d]; k / v: [L, num_kv_heads * d]; bf16 rows with unit stride inside
    (any row stride). Probabilities are rounded to bf16 for the product with V (as SDPA's bf16
    path does), the normalizer is an fp32 sum.
    """
    rc = ops._lib.minivllm_prefill_attention_bf16(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        out.data_ptr(), out.stride(0), q.shape[0], num_heads, num_kv_heads, head_size, scale,
        torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"prefill attention kernel rejected L={q.shape[0]}, "
                         f"heads={num_heads}/{num_kv_heads}, d={head_size} (rc={rc})")
