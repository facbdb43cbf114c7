"""KV cache blocks: a free list in eviction order, reference counts and the prefix-cache map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# A block hash is hash((parent_block_hash, tuple(token_ids_of_the_block))): chaining the parent
# makes equal hashes mean equal prefixes, not only equal blocks. Python's hash of a tuple of
# ints is deterministic across processes (no hash randomisation for ints and tuples).
BlockHash = int


def hash_block_tokens(parent_block_hash: BlockHash | None, block_token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """Hash of one full block, chained to the hash of the block before it (None for the first).

    `extra_keys` is what else changed the KV (the LoRA adapter: two adapters never share a block).
    """
    if extra_keys is None:
        return hash((parent_block_hash, tuple(block_token_ids)))
    return hash((parent_block_hash, tuple(block_token_ids), extra_keys))


@dataclass(eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block; the tensors live in the model runner."""

    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every block.

    Free blocks wait in `free_block_queue`, an ordered map used as a queue: new blocks are taken
    from the front, freed blocks join the back. A freed block keeps its hash (and stays
    findable in the prefix cache) until it is taken for new content, so the front holds the
    least recently used cached blocks: they are evicted first.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes blocks from the front of the free queue, evicting their cached content."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.get_num_free_blocks()} free).")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching zero join the back of the free queue in
        the given order (so the first ones given are evicted first)."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Registers `blocks[num_cached_blocks:num_full_blocks]`, now full, in the prefix cache."""
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None:
                continue   # a prefix-cache hit: already registered
            # NOTE: if another block already holds the same content (two requests computed the
            # same prefix at once), the first one stays the canonical copy and this one stays
            # unregistered; it is freed and reused like any uncached block.
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block. Refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
