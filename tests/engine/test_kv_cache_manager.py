"""KVCacheManager: allocation, prefix-cache hits, eviction order, refcounts, free."""

from minivllm.engine.kv_cache_manager import KVCacheManager
from minivllm.engine.request import Request
from minivllm.sampling_params import SamplingParams

BS = 4


def make_request(req_id, tokens, **kwargs):
    return Request(req_id, tokens, SamplingParams(**kwargs))


def admit(manager, request):
    """What the scheduler does on admission: hits, then slots for the rest of the prompt."""
    blocks, num_computed = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_computed, blocks)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return num_computed, new


def test_allocation_rounds_up_to_blocks_and_returns_new_ids():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    r = make_request("a", list(range(10)))
    num_computed, new = admit(m, r)
    assert num_computed == 0 and len(new) == 3
    assert m.get_block_ids("a") == new and m.num_free_blocks == 5
    # Decode tokens 10 and 11 fit the third block; token 12 needs a fourth.
    r.append_output_token_ids(100)
    assert m.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    r.append_output_token_ids(101)
    assert m.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    r.append_output_token_ids(102)
    assert len(m.allocate_slots(r, 1)) == 1


def test_prefix_hit_shares_blocks_and_keeps_the_last_token():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(12)))
    admit(m, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    num_computed, _ = admit(m, b)
    assert num_computed == 8
    assert m.get_block_ids("b")[:2] == m.get_block_ids("a")[:2]
    assert [blk.ref_cnt for blk in m.req_to_blocks["a"][:2]] == [2, 2]
    # A prompt fully in the cache still recomputes its last token (one block short).
    c = make_request("c", list(range(12)))
    num_computed, _ = admit(m, c)
    assert num_computed == 8


def test_decode_fills_and_caches_blocks():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", [1, 2, 3])
    admit(m, a)
    a.append_output_token_ids(4)            # token 4 completes block 0 when computed
    m.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    m.free(a)
    b = make_request("b", [1, 2, 3, 4, 5])
    assert m.get_computed_blocks(b)[1] == 4


def test_no_hits_when_caching_is_off_or_prompt_logprobs_are_asked():
    for m, params in ((KVCacheManager(8, BS, enable_prefix_caching=False), {}),
                      (KVCacheManager(8, BS), {"prompt_logprobs": 1})):
        admit(m, make_request("a", list(range(9))))
        assert m.get_computed_blocks(make_request("b", list(range(9)), **params))[1] == 0


def test_free_evicts_least_recently_used_and_tails_first():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))     # 3 blocks, 2 full and cached
    admit(m, a)
    ids = m.get_block_ids("a")
    m.free(a)
    assert m.num_free_blocks == 4 and m.usage == 0.0
    # Tail first: the partial block, then block 1, then block 0 (the shared-prefix head).
    assert list(m.block_pool.free_block_queue)[-3:] == ids[::-1]
    # A new unrelated request takes the never-used block, then a's tail, keeping a's head.
    b = make_request("b", [7] * 6)
    admit(m, b)
    assert m.get_block_ids("b") == [3, ids[2]]
    c = make_request("c", list(range(8)) + [60])
    assert m.get_computed_blocks(c)[1] == 8


def test_allocation_failure_changes_nothing():
    m = KVCacheManager(num_blocks=2, block_size=BS)
    a = make_request("a", list(range(12)))
    assert m.allocate_slots(a, 12) is None
    assert m.num_free_blocks == 2 and m.get_block_ids("a") == []


def test_hits_on_free_blocks_count_against_free_space():
    m = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(m, a)
    m.free(a)                                   # 2 cached blocks, all 3 free
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5])
    blocks, num_computed = m.get_computed_blocks(b)
    assert num_computed == 8
    # 13 tokens need 4 blocks: 2 hits + 2 new, but only 1 block is free besides the hits.
    assert m.allocate_slots(b, 5, blocks) is None
    assert all(blk.ref_cnt == 0 for blk in blocks) and m.num_free_blocks == 3


def test_reset_prefix_cache():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(m, a)
    assert not m.reset_prefix_cache()
    m.free(a)
    assert m.reset_prefix_cache()
    assert m.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def test_cache_salt_isolates_prefixes():
    """A salted request shares blocks only with requests of the same salt, and no salt is a
    salt of its own: equal prompts under other salts miss the cache."""
    m = KVCacheManager(num_blocks=32, block_size=BS)
    tokens = list(range(13))
    admit(m, make_request("plain", tokens))
    hits = {}
    for name, salt in (("a1", "tenant-a"), ("b1", "tenant-b"), ("a2", "tenant-a"),
                       ("plain2", None)):
        r = Request(name, tokens, SamplingParams(), cache_salt=salt)
        hits[name] = admit(m, r)[0]
    assert hits == {"a1": 0, "b1": 0, "a2": 12, "plain2": 12}
    assert m.get_block_ids("a2")[:3] == m.get_block_ids("a1")[:3]
    assert not set(m.get_block_ids("a1")) & set(m.get_block_ids("b1"))
    assert not set(m.get_block_ids("a1")) & set(m.get_block_ids("plain"))
    # Every block of a salted prompt hashes apart (the first takes the salt, chaining the rest).
    salted = Request("s", tokens, SamplingParams(), cache_salt="tenant-a")
    admit(m, salted)
    plain = m.req_to_blocks["plain"]
    assert all(x.block_hash != y.block_hash for x, y in zip(m.req_to_blocks["s"][:3], plain))
