"""BlockPool: free-queue order, reference counts and the prefix-cache map."""

import pytest

from minivllm.engine.block_pool import BlockPool, hash_block_tokens


def test_new_blocks_come_from_the_front_and_count_as_used():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 1 and pool.get_usage() == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_freed_blocks_join_the_back_in_the_given_order():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.free_blocks(reversed(a))   # [2, 3, 1, 0]
    assert list(pool.free_block_queue) == [2, 3, 1, 0]


def test_touch_and_refcounts():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and b.block_id not in pool.free_block_queue
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and b.block_id in pool.free_block_queue
    pool.touch([b])   # a prefix hit on a free block pulls it out of the free queue
    assert b.ref_cnt == 1 and b.block_id not in pool.free_block_queue


def test_cached_free_block_survives_until_evicted_lru_first():
    pool = BlockPool(2)
    b0, b1 = pool.get_new_blocks(2)
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(None, [3, 4])
    pool.cache_full_blocks([b0], [h0], 0, 1)
    pool.cache_full_blocks([b1], [h1], 0, 1)
    pool.free_blocks([b0, b1])            # b0 is least recently used
    assert pool.get_cached_block(h0) is b0 and pool.get_cached_block(h1) is b1
    (new,) = pool.get_new_blocks(1)
    assert new is b0 and new.block_hash is None
    assert pool.get_cached_block(h0) is None and pool.get_cached_block(h1) is b1


def test_hash_chain_depends_on_the_parent():
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(None, (1, 2))
    parent_a, parent_b = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    assert hash_block_tokens(parent_a, [5]) != hash_block_tokens(parent_b, [5])


def test_duplicate_content_keeps_the_first_block():
    pool = BlockPool(2)
    b0, b1 = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [9])
    pool.cache_full_blocks([b0], [h], 0, 1)
    pool.cache_full_blocks([b1], [h], 0, 1)
    assert pool.get_cached_block(h) is b0 and b1.block_hash is None


def test_caching_off_and_reset():
    off = BlockPool(1, enable_caching=False)
    (b,) = off.get_new_blocks(1)
    off.cache_full_blocks([b], [123], 0, 1)
    assert off.get_cached_block(123) is None
    pool = BlockPool(1)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [123], 0, 1)
    assert not pool.reset_prefix_cache()   # refused while in use
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() and pool.get_cached_block(123) is None
