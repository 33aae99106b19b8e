"""`KVCacheManager`: block tables of requests over a `BlockPool`, with prefix caching.

Paged attention (Kwon et al., 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention"): token ``t`` of a request lives in slot ``t % block_size`` of
block ``block_table[t // block_size]``. The manager grows each request's block table as the
scheduler hands it more tokens, and shares full blocks between requests with equal prefixes
(vLLM v1's ``KVCacheManager``: `get_computed_blocks` finds the longest cached prefix,
`allocate_slots` takes the blocks, `cache_blocks` publishes full computed blocks, `free`
returns them). Torch-free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from pkgd.engine.block_pool import ROOT_HASH, BlockPool, KVCacheBlock, hash_block_tokens
from pkgd.engine.request import Request


def lora_root_hash(request: Request) -> bytes | None:
    """The parent hash of a request's first block: None (the shared root) for the base model;
    for an adapter, a hash of the root and the adapter's id, name and path (its KV differs from
    the base model's and from every other adapter's for the same tokens; vLLM keys on the id)."""
    lora = request.lora_request
    if lora is None:
        return None
    key = f"lora\0{lora.lora_int_id}\0{lora.lora_name}\0{lora.lora_path}".encode()
    return hashlib.sha256(ROOT_HASH + key).digest()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


class KVCacheManager:
    """Block tables and prefix caching for one engine's KV cache.

    Args:
        num_blocks: blocks in the cache.
        block_size: token slots per block.
        enable_caching: share full blocks of equal prefixes between requests.

    Every call that could run out of blocks first checks and returns None, changing nothing;
    the scheduler reacts (preempts or waits).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix-cache map.
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (block ids in token order)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- prefix caching -----------------------------------------------------------------

    def update_block_hashes(self, request: Request) -> list[bytes]:
        """Extend ``request.block_hashes`` to cover every full block of its tokens. A request
        with a LoRA adapter chains from a root of its own (`lora_root_hash`), so the same
        tokens under two adapters, or an adapter and the base model, never share a block."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else lora_root_hash(request)
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks matching the request's leading full blocks.

        Returns ``(blocks, num_computed_tokens)``; no side effects besides extending
        ``request.block_hashes``. At least the last token is always left to compute (its
        logits or its pooled hidden state are needed), and requests asking for prompt logprobs
        or marked ``skip_prefix_cache`` get no hits (every prompt position must be computed).
        """
        if not self.enable_caching or request.wants_prompt_logprobs or request.skip_prefix_cache:
            return [], 0
        hashes = self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    # ---- allocation -----------------------------------------------------------------------

    def _num_blocks_to_take(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        held = len(self.req_to_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = self.num_blocks_for_tokens(num_computed + num_new_tokens) - held
        # Hit blocks that are free still count against the free pool when taken back.
        return max(need, 0) + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def can_allocate(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> bool:
        """Whether `allocate_slots` with the same arguments would succeed. No side effects."""
        return self._num_blocks_to_take(request, num_new_tokens, new_computed_blocks) <= self.get_num_free_blocks()

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[int] | None:
        """Give the request slots for ``num_new_tokens`` more tokens.

        ``new_computed_blocks`` (first scheduling only) are prefix-cache hits from
        `get_computed_blocks`: they join the block table first and are counted as computed.
        Returns the ids of blocks appended to the block table (hits included), or None,
        changing nothing, when the free blocks do not suffice.
        """
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if new_computed_blocks:
            self.num_cached_blocks[request.request_id] = len(blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = self.num_blocks_for_tokens(num_computed + num_new_tokens) - len(blocks)
        new_blocks = self.block_pool.get_new_blocks(max(need, 0))
        assert new_blocks is not None  # checked by can_allocate
        blocks.extend(new_blocks)
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks whose KV is written (the first
        ``num_computed_tokens // block_size``) in the prefix-cache map."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        done = self.num_cached_blocks.get(rid, 0)
        if num_full <= done:
            return
        hashes = self.update_block_hashes(request)
        self.block_pool.cache_full_blocks(blocks[done:num_full], hashes[done:num_full])
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Return all the request's blocks. Tail blocks are freed first, so they are evicted
        before the prefix blocks other requests are likelier to share."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing changed) while any block is in use."""
        return self.block_pool.reset_prefix_cache()
