"""The pool of KV-cache blocks: reference counts, an LRU free queue and the prefix-cache map.

vLLM v1's design (``vllm/v1/core/block_pool.py``, "Automatic Prefix Caching" in vLLM's docs):

* Every block has a reference count: the number of running requests whose block table holds
  it. A block with count 0 is *free*: it sits in the free queue, in least-recently-freed order.
* A full block may carry a *block hash*: a hash chained over its parent block's hash and its
  own token ids, so equal hashes mean equal whole prefixes. Cached blocks are found by hash
  in ``cached_blocks``. A freed block keeps its hash and KV, so a later request with the same
  prefix can take it back out of the free queue (a prefix-cache hit).
* New blocks come from the head of the free queue (the least recently freed); a block taken
  that still carries a hash is evicted from the map first (LRU eviction).
* Blocks never used yet are *cold* and are handed out only when no used (*warm*) block is
  free, lowest id first. On CPU the runner's cache becomes resident only where it is written
  (`pkgd.runner.allocator.lazy_zeroed_buffers`), so reusing warm blocks first keeps the
  engine's memory at the most blocks it ever held at once, whatever the budget. The price: a
  freed prefix is evicted (LRU among warm blocks) rather than kept while a cold block would
  do, so the prefix cache holds what fits in that working set.

The pool is dumb and honest: it knows nothing of queues or priorities,
answers "how many are free" without side effects, and running out is a normal return value
(`get_new_blocks` returns None), never an exception. Torch-free.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

# Parent hash of the first block of every sequence. Fixed: hashes never leave the process.
ROOT_HASH = hashlib.sha256(b"pkgd/prefix-cache/root").digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: SHA-256 over the parent's hash and the block's tokens.

    SHA-256 rather than Python's ``hash`` because a collision would silently hand one
    request another request's KV (vLLM moved to SHA-256 for the same reason). Token ids are
    packed as signed 64-bit integers. Returns 32 bytes.
    """
    h = hashlib.sha256(parent_hash if parent_hash is not None else ROOT_HASH)
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


@dataclasses.dataclass(eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's KV cache.

    ``block_id`` indexes the runner's cache tensors; ``ref_cnt`` counts the requests using it;
    ``block_hash`` is set while it is in the prefix-cache map.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class FreeBlockQueue:
    """Free blocks in eviction order: head = least recently freed, popped first.

    An ordered dict keyed by block id gives O(1) append, pop-head and removal from the middle
    (a cached block taken back by a prefix hit), which is all vLLM's hand-written doubly
    linked list provides.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._blocks: collections.OrderedDict[int, KVCacheBlock] = collections.OrderedDict(
            (b.block_id, b) for b in blocks
        )

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._blocks

    def popleft(self) -> KVCacheBlock:
        return self._blocks.popitem(last=False)[1]

    def append(self, block: KVCacheBlock) -> None:
        self._blocks[block.block_id] = block

    def remove(self, block: KVCacheBlock) -> None:
        del self._blocks[block.block_id]

    def block_ids(self) -> list[int]:
        """Ids in eviction order (for tests and debugging)."""
        return list(self._blocks)


class BlockPool:
    """All ``num_blocks`` blocks of one engine's KV cache.

    Args:
        num_blocks: blocks in the cache (at least 1).
        enable_caching: keep hashes of full blocks so later requests can reuse them.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(())  # warm free blocks only
        self._cold = self.blocks[::-1]  # never used; pop() gives the lowest id
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        """Blocks that `get_new_blocks` can hand out now (free, cached or not, warm or cold)."""
        return len(self.free_block_queue) + len(self._cold)

    @property
    def num_blocks_used(self) -> int:
        """Blocks ever handed out (warm): the high-water mark of blocks in use at once."""
        return self.num_blocks - len(self._cold)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block holding the prefix ending in ``block_hash``, or None. No side effects."""
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Take ``num_blocks`` blocks (ref count 1): from the head of the free queue, then cold
        blocks once it is empty.

        Returns None, changing nothing, when fewer are free. Taken blocks that were cached are
        evicted from the prefix-cache map.
        """
        if num_blocks > self.get_num_free_blocks():
            return None
        taken = []
        for _ in range(num_blocks):
            if self.free_block_queue:
                block = self.free_block_queue.popleft()
                self._evict(block)
            else:
                block = self._cold.pop()
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request starts using already-filled blocks (prefix hit): count it, un-free them."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail in
        the given order (so the first given are evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes]) -> None:
        """Enter full, computed blocks into the prefix-cache map, ``blocks[i]`` under
        ``block_hashes[i]``.

        A hash already mapped to another block (two requests computed the same prefix at the
        same time) keeps the first block; the duplicate stays uncached and is simply reused
        once freed.
        """
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block_hash in self.cached_blocks:
                continue
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use (returns False
        otherwise, changing nothing)."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
