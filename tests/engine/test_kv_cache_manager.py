"""KVCacheManager: block tables, side-effect-free checks, prefix hits with chained hashes."""

from pkgd.engine.kv_cache_manager import KVCacheManager
from pkgd.engine.request import Request
from pkgd.sampling_params import SamplingParams


def req(rid, tokens, **sp):
    return Request(rid, tokens, SamplingParams(**sp), max_model_len=1024)


def admit(kv, r):
    """What the scheduler does for a waiting request: hits, then slots for the rest."""
    hits, num_hit = kv.get_computed_blocks(r)
    ids = kv.allocate_slots(r, r.num_tokens - num_hit, hits)
    assert ids is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r, r.num_computed_tokens)
    return num_hit


def test_block_table_grows_one_block_per_block_size_tokens():
    kv = KVCacheManager(8, 4)
    r = req("a", list(range(6)))
    assert kv.allocate_slots(r, 6) == [0, 1]
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 2) == []  # slots 6, 7 fit in block 1
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1) == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(2, 4)
    r = req("a", list(range(12)))
    assert not kv.can_allocate(r, 12)
    assert kv.allocate_slots(r, 12) is None
    assert kv.get_num_free_blocks() == 2 and kv.get_block_ids("a") == []


def test_free_returns_every_block():
    kv = KVCacheManager(4, 4)
    r = req("a", list(range(10)))
    kv.allocate_slots(r, 10)
    assert kv.get_num_free_blocks() == 1
    kv.free(r)
    assert kv.get_num_free_blocks() == 4 and kv.usage == 0.0


def test_shared_prefix_hits_full_blocks_and_shares_them():
    kv = KVCacheManager(16, 4)
    prefix = list(range(100, 108))  # two full blocks
    a = req("a", prefix + [1, 2, 3])
    assert admit(kv, a) == 0
    b = req("b", prefix + [9, 9])
    assert admit(kv, b) == 8
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert all(blk.ref_cnt == 2 for blk in kv.req_to_blocks["b"][:2])


def test_hit_stops_at_the_first_different_block():
    kv = KVCacheManager(16, 4)
    admit(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second block, different first: chained hashes differ, no hit at all
    assert kv.get_computed_blocks(req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 0
    assert kv.get_computed_blocks(req("c", [1, 2, 3, 4, 0, 6, 7, 8, 9]))[1] == 4


def test_last_token_is_always_computed():
    kv = KVCacheManager(16, 4)
    admit(kv, req("a", list(range(8))))
    blocks, n = kv.get_computed_blocks(req("b", list(range(8))))
    assert n == 4 and len(blocks) == 1  # 8 tokens fully cached, yet one block is recomputed


def test_finished_request_blocks_stay_cached_until_evicted():
    kv = KVCacheManager(4, 4)
    a = req("a", list(range(8)) + [50])
    admit(kv, a)
    kv.free(a)
    assert kv.get_num_free_blocks() == 4
    b = req("b", list(range(8)) + [60])
    assert admit(kv, b) == 8
    kv.free(b)
    filler = req("c", list(range(200, 216)))  # needs all 4 blocks: evicts the cached ones
    assert admit(kv, filler) == 0
    kv.free(filler)
    assert kv.get_computed_blocks(req("d", list(range(8)) + [1]))[1] == 0


def test_free_hit_blocks_count_against_the_free_pool():
    kv = KVCacheManager(3, 4)
    a = req("a", list(range(8)) + [1])
    admit(kv, a)
    kv.free(a)  # 3 free, two of them cached
    b = req("b", list(range(8)) + [2, 3, 4, 5, 6])  # 13 tokens: 4 blocks, 2 of them hits
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert not kv.can_allocate(b, b.num_tokens - n, hits)
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is None
    assert kv.get_num_free_blocks() == 3


def test_prompt_logprobs_requests_get_no_hits():
    kv = KVCacheManager(8, 4)
    admit(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9)), prompt_logprobs=1))[1] == 0


def test_caching_disabled_gives_no_hits():
    kv = KVCacheManager(8, 4, enable_caching=False)
    admit(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0
