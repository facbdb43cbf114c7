"""Per-request block tables over the block pool, with hash-chained prefix caching."""

from __future__ import annotations

import hashlib

import torch

from minivllm.engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from minivllm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    """Gives each request the blocks its tokens need, and finds cached prefixes.

    Only full blocks are cached. A block is registered as soon as the tokens scheduled for it
    fill it (during prefill and decode alike): its KV is written in the same forward pass that
    any later reader would come after.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> number of its leading blocks already registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, as (blocks, num_computed_tokens).

        NOTE: never covers every token: the last one is always recomputed so that the step
        produces logits to sample from.
        """
        # Prompt logprobs need the logits of every prompt position, so cached KV is no help.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break   # hashes are chained: nothing after a miss can hit
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Makes room for `num_new_tokens` more tokens after the computed ones, and slots for
        `num_lookahead_tokens` past them (a draft model writes its proposals there).

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` (admission
        only). Returns the ids of the newly allocated blocks, or None (and changes nothing)
        when the pool has too few free blocks.
        """
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = (request.num_computed_tokens
                               + len(new_computed_blocks) * self.block_size)
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_required = (cdiv(num_total_tokens + num_lookahead_tokens, self.block_size)
                        - len(req_blocks) - len(new_computed_blocks))
        # Hits that sit in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_required > self.num_free_blocks - num_evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_required, 0))
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            # Draft tokens are not known tokens yet: blocks they fill are cached once verified.
            self._cache_blocks(request, min(num_total_tokens, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Releases the request's blocks. The tail is freed first so that it is evicted before
        the head: heads are the prefixes other requests are likely to share."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached blocks; False (nothing done) while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request) -> None:
        """Extends `request.block_hashes` to every full block of its known tokens."""
        bs = self.block_size
        token_ids = request.all_token_ids
        hashes = request.block_hashes
        lora = getattr(request, "lora_request", None)
        extra = (lora.lora_int_id, lora.lora_name) if lora is not None else None
        # The cache salt keys the first block only: chaining carries it into every later hash.
        salt = getattr(request, "cache_salt", None)
        first_extra = extra if salt is None else (extra, "cache_salt", salt)
        embeds = getattr(request, "prompt_embeds", None)
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[i - 1] if i > 0 else None
            keys = extra if i > 0 else first_extra
            if embeds is not None and i * bs < len(embeds):   # stand-in ids: key the vectors
                keys = (keys, embeds_digest(embeds[i * bs:(i + 1) * bs]))
            hashes.append(hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs], keys))

    def _cache_blocks(self, request: Request, num_total_tokens: int) -> None:
        num_full_blocks = num_total_tokens // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full_blocks <= num_cached:
            return
        self._update_block_hashes(request)
        self.block_pool.cache_full_blocks(self.req_to_blocks[request.request_id],
                                          request.block_hashes, num_cached, num_full_blocks)
        self.num_cached_block[request.request_id] = num_full_blocks


def embeds_digest(embeds: torch.Tensor) -> bytes:
    """SHA-256 of the raw bytes of prompt embeddings [n, H]: equal only for equal vectors."""
    raw = embeds.contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).digest()
