"""BlockPool: reference counts, LRU free queue, prefix-cache map, chained hashes."""

from pkgd.engine.block_pool import BlockPool, hash_block_tokens


def test_new_blocks_come_from_the_free_queue_and_running_out_returns_none():
    pool = BlockPool(4)
    taken = pool.get_new_blocks(3)
    assert [b.block_id for b in taken] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in taken)
    assert pool.get_num_free_blocks() == 1
    assert pool.get_new_blocks(2) is None  # not enough: nothing changes
    assert pool.get_num_free_blocks() == 1
    assert pool.usage == 0.75


def test_freed_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([b])
    pool.free_blocks([a, c])
    assert pool.free_block_queue.block_ids() == [1, 0, 2]
    assert [x.block_id for x in pool.get_new_blocks(2)] == [1, 0]


def test_shared_block_is_free_only_when_the_last_user_lets_go():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])  # a second request shares it
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert pool.get_num_free_blocks() == 1
    pool.free_blocks([blk])
    assert pool.get_num_free_blocks() == 2


def test_cached_free_block_is_a_hit_and_touch_takes_it_off_the_free_queue():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_blocks([blk], [h])
    pool.free_blocks([blk])
    assert pool.get_cached_block(h) is blk and pool.get_num_free_blocks() == 3
    pool.touch([blk])
    assert blk.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert blk not in pool.free_block_queue


def test_lru_eviction_drops_the_hash_of_a_reused_block():
    pool = BlockPool(2)
    x, y = pool.get_new_blocks(2)
    hx, hy = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    pool.cache_full_blocks([x, y], [hx, hy])
    pool.free_blocks([x, y])  # x freed first: least recently used
    (taken,) = pool.get_new_blocks(1)
    assert taken is x and x.block_hash is None
    assert pool.get_cached_block(hx) is None
    assert pool.get_cached_block(hy) is y


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(2)
    x, y = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [7, 7])
    pool.cache_full_blocks([x], [h])
    pool.cache_full_blocks([y], [h])
    assert pool.get_cached_block(h) is x and y.block_hash is None


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(b, [5, 6])
    assert hash_block_tokens(a, [5, 6]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [5, 6])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([blk], [b"h" * 32])
    assert pool.reset_prefix_cache() is False and pool.get_cached_block(b"h" * 32) is blk
    pool.free_blocks([blk])
    assert pool.reset_prefix_cache() is True and pool.get_cached_block(b"h" * 32) is None


def test_warm_blocks_are_reused_before_cold_ones():
    pool = BlockPool(8)
    a, b = pool.get_new_blocks(2)
    assert pool.num_blocks_used == 2 and pool.get_num_free_blocks() == 6
    pool.free_blocks([b, a])
    # the freed (warm) blocks come back first, in free order; cold ones only after, lowest id first
    assert [x.block_id for x in pool.get_new_blocks(3)] == [1, 0, 2]
    assert pool.num_blocks_used == 3


def test_a_warm_cached_block_is_evicted_before_a_cold_block_is_touched():
    pool = BlockPool(4)
    (x,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([x], [h])
    pool.free_blocks([x])
    (taken,) = pool.get_new_blocks(1)
    assert taken is x and pool.get_cached_block(h) is None and pool.num_blocks_used == 1


def test_steady_load_stays_within_its_working_set():
    pool = BlockPool(1000)
    for _ in range(50):  # 50 rounds of 4 requests x 8 blocks, each round freed before the next
        held = [pool.get_new_blocks(8) for _ in range(4)]
        for blocks in held:
            pool.free_blocks(reversed(blocks))
    assert pool.num_blocks_used == 32 and pool.get_num_free_blocks() == 1000
