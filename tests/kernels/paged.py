"""Builds small paged-attention batches, and the dense causal attention they must equal."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pkgd_kernels import reshape_and_cache_ref


@dataclass
class PagedBatch:
    """One step's attention inputs plus the dense per-sequence K/V they were built from."""

    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]; never-written slots are NaN
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, max_blocks]; padding entries 0 (a NaN block)
    seq_lens: torch.Tensor  # int32 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    values: list[torch.Tensor]
    q_lens: list[int]

    @property
    def decode_args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens)

    @property
    def prefill_args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.query_start_loc, self.seq_lens)


def make_batch(
    generator: torch.Generator,
    seq_lens: list[int],
    q_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    spare_columns: int = 1,
) -> PagedBatch:
    """Scatter random per-sequence K/V into shuffled cache blocks (block 0 stays unused).

    Block ids come from a random permutation, so sequences' blocks interleave; the block table
    gets ``spare_columns`` padding columns; every slot no token was written to holds NaN, so a
    kernel that reads past a sequence's length, or through a padding entry, yields NaN.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2
    ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    width = max(blocks_per_seq, default=0) + spare_columns
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    keys, values = [], []
    for s, (length, n_blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        table = [ids.pop() for _ in range(n_blocks)]
        block_tables[s, :n_blocks] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(length, num_kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(length, num_kv_heads, head_dim, generator=generator).to(dtype)
        pos = torch.arange(length)
        slots = torch.tensor(table, dtype=torch.int64)[pos // block_size] * block_size
        reshape_and_cache_ref(k, v, key_cache, value_cache, slots + pos % block_size)
        keys.append(k)
        values.append(v)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=generator).to(dtype)
    return PagedBatch(
        query,
        key_cache,
        value_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        keys,
        values,
        list(q_lens),
    )


def zero_padding(batch: PagedBatch) -> PagedBatch:
    """``batch`` with its never-written slots zeroed, as a runner allocates its caches: the CPU
    forms read whole blocks (every ``p * V`` of a masked slot must be finite), the references
    and Triton kernels only a sequence's own positions."""
    batch.key_cache.nan_to_num_(0.0)
    batch.value_cache.nan_to_num_(0.0)
    return batch


def dense_causal_attention(
    batch: PagedBatch, scale: float, sliding_window: int = 0, soft_cap: float = 0.0
) -> torch.Tensor:
    """Textbook attention per sequence and head in float64 from the unpaged K/V:
    ``softmax(cap(scale * Q K^T) + causal mask) V``, query row i at position
    seq_len - q_len + i; with ``sliding_window`` W only keys ``j > position - W``; with
    ``soft_cap`` c, ``cap(x) = c * tanh(x / c)``."""
    num_heads = batch.query.shape[1]
    group = num_heads // batch.keys[0].shape[1] if batch.keys else 1
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    start = 0
    for keys, values, q_len in zip(batch.keys, batch.values, batch.q_lens):
        length = keys.shape[0]
        q = batch.query[start : start + q_len].double()
        positions = torch.arange(length - q_len, length)
        causal = torch.arange(length)[None, :] <= positions[:, None]
        if sliding_window:
            causal &= torch.arange(length)[None, :] > positions[:, None] - sliding_window
        for h in range(num_heads):
            scores = scale * q[:, h] @ keys[:, h // group].double().T
            if soft_cap:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            scores = scores.masked_fill(~causal, float("-inf"))
            out[start : start + q_len, h] = scores.softmax(-1) @ values[:, h // group].double()
        start += q_len
    return out
