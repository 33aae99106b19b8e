"""The CPU PyTorch forms of paged attention (`paged_attention_decode_cpu`,
`paged_attention_prefill_cpu`) and the per-step plans they can reuse across layers.

Same contract as :mod:`pkgd_kernels.attention` (cache layout, metadata, results), plus one
CPU-only freedom: the cache may hold 16-bit K/V under float32 queries (``cache.cache_dtype``),
attended in the query dtype.

* decode: sequences are processed in chunks whose gathered K/V (``index_select`` of whole
  blocks) stays about `DECODE_CHUNK_BYTES`, so it is re-read from cache rather than DRAM and
  every temporary stays under the engine's 1 MiB mmap threshold (a fresh mmapped buffer per
  layer costs more in page faults than the attention itself). Each chunk is one
  ``scaled_dot_product_attention`` call with an additive length mask (none when the chunk's
  lengths are equal), the G = Hq/Hkv query heads of each KV head grouped as that head's G
  queries: one read of K/V serves them all (~10% faster than ``enable_gqa``).
* prefill: per sequence, over its gathered blocks; a prompt with no cached context is plain
  causal attention (``is_causal``), a chunk after cached context uses an explicit causal mask
  aligned bottom-right (query i sits at position ``seq_len - q_len + i``).

Sliding window and soft cap: the plans know neither (a model's layers differ in both), so a
sequence the window cuts (more keys than the window) gets its mask built here, attended by
``scaled_dot_product_attention`` with that mask; with a soft cap the scores are computed
explicitly in float32 (`_attend_masked`), since SDPA has no hook between the product and the
softmax. Sequences within the window and layers without a cap keep the fast paths above.

A plan (`plan_decode`, `plan_prefill`) depends only on the step's block tables and lengths, so
a runner builds it once per step and passes it to every layer's call (``plan=``: the plan, or a
function returning it, called only when this form runs, so a step the C kernel serves never
builds one); without one the call builds its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

DECODE_CHUNK_BYTES = 1 << 20
"""Bytes of gathered K+V per decode chunk (fits in L2 beside the weights' stream; K and V
each stay under a 1 MiB mmap threshold)."""


@dataclasses.dataclass
class DecodeChunk:
    """Decode sequences ``[seq_start, seq_end)`` gathered together."""

    seq_start: int
    seq_end: int
    block_ids: torch.Tensor  # int64 [(seq_end - seq_start) * num_blocks]
    mask: torch.Tensor | None  # float32 additive (0 / -inf) [n, 1, 1, num_blocks * block_size]
    max_len: int  # longest sequence; with no mask, every sequence has this length


@dataclasses.dataclass
class PrefillSeq:
    """One prefill sequence: query rows ``[token_start, token_end)`` of the call's query."""

    token_start: int
    token_end: int
    seq_len: int  # keys including this step's tokens
    block_ids: torch.Tensor  # int64 [ceil(seq_len / block_size)]
    mask: torch.Tensor | None  # bool [1, 1, q_len, seq_len]; None when no cached context (causal)


def plan_decode(
    block_tables: torch.Tensor, seq_lens: list[int], block_size: int, kv_bytes_per_token: int
) -> list[DecodeChunk]:
    """Chunks of the decode sequences (``block_tables`` int32 ``[S, max_blocks]`` on CPU,
    ``seq_lens`` their lengths) for `paged_attention_decode_cpu`; ``kv_bytes_per_token`` is one
    token's K+V of one layer as attended (sizes the chunks)."""
    chunks = []
    n = len(seq_lens)
    start = 0
    while start < n:
        end = start + 1
        longest = seq_lens[start]
        while end < n:
            longest_next = max(longest, seq_lens[end])
            nb = -(-longest_next // block_size)
            if (end + 1 - start) * nb * block_size * kv_bytes_per_token > DECODE_CHUNK_BYTES:
                break
            longest = longest_next
            end += 1
        nb = -(-longest // block_size)
        ids = block_tables[start:end, :nb].to(torch.int64).reshape(-1)
        lens = seq_lens[start:end]
        if min(lens) == longest:  # equal lengths: slice the gathered K/V, no mask
            chunks.append(DecodeChunk(start, end, ids, None, longest))
        else:  # additive mask: SDPA would convert a boolean one on every call
            mask = torch.zeros(end - start, nb * block_size)
            mask.masked_fill_(torch.arange(nb * block_size)[None, :] >= torch.tensor(lens)[:, None], float("-inf"))
            chunks.append(DecodeChunk(start, end, ids, mask.view(end - start, 1, 1, -1), longest))
        start = end
    return chunks


def plan_prefill(
    block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int], block_size: int
) -> list[PrefillSeq]:
    """Per-sequence gathers and masks (``block_tables`` int32 ``[S, max_blocks]`` on CPU,
    ``query_start_loc`` ``S + 1`` offsets from 0, ``seq_lens`` ``S`` lengths) for
    `paged_attention_prefill_cpu`."""
    out = []
    for i, seq_len in enumerate(seq_lens):
        a, b = query_start_loc[i], query_start_loc[i + 1]
        ctx = seq_len - (b - a)
        ids = block_tables[i, : -(-seq_len // block_size)].to(torch.int64)
        mask = None
        if ctx > 0:
            pos = torch.arange(ctx, seq_len)
            mask = (torch.arange(seq_len)[None, :] <= pos[:, None]).view(1, 1, b - a, seq_len)
        out.append(PrefillSeq(a, b, seq_len, ids, mask))
    return out


def kv_bytes_per_token(query: torch.Tensor, key_cache: torch.Tensor) -> int:
    """K+V bytes of one token of one layer as the decode chunks hold them."""
    _, _, hkv, d = key_cache.shape
    return 2 * hkv * d * max(key_cache.element_size(), query.element_size())


def paged_attention_decode_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    *,
    plan: list[DecodeChunk] | Callable[[], list[DecodeChunk]] | None = None,
) -> torch.Tensor:
    """CPU form of `pkgd_kernels.paged_attention_decode_ref` (same arguments and result;
    unchecked), with ``plan`` from `plan_decode` for these tables and lengths when the caller
    has one. The cache may be 16-bit under float32 queries."""
    if callable(plan):
        plan = plan()
    if plan is None:
        plan = plan_decode(block_tables, seq_lens.tolist(), key_cache.shape[1], kv_bytes_per_token(query, key_cache))
    _, _, hkv, d = key_cache.shape
    hq = query.shape[1]
    options = (seq_lens, sliding_window, soft_cap)
    if len(plan) == 1:
        return _decode_chunk(query, key_cache, value_cache, plan[0], scale, hq, hkv, d, *options)
    out = torch.empty_like(query)
    for c in plan:
        out[c.seq_start : c.seq_end] = _decode_chunk(
            query[c.seq_start : c.seq_end], key_cache, value_cache, c, scale, hq, hkv, d, *options
        )
    return out


def _decode_chunk(
    q, key_cache, value_cache, c: DecodeChunk, scale, hq, hkv, d, seq_lens, sliding_window, soft_cap
) -> torch.Tensor:
    n = c.seq_end - c.seq_start
    k = key_cache.index_select(0, c.block_ids).view(n, -1, hkv, d)
    v = value_cache.index_select(0, c.block_ids).view(n, -1, hkv, d)
    if soft_cap or (sliding_window and c.max_len > sliding_window):
        lens = seq_lens[c.seq_start : c.seq_end].long()[:, None]
        pos = torch.arange(k.shape[1])[None, :]
        visible = (pos < lens) & (pos >= lens - sliding_window) if sliding_window else pos < lens
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = _attend_masked(
            q.view(n, hq, 1, d), k.transpose(1, 2), v.transpose(1, 2), visible.view(n, 1, 1, -1), scale, soft_cap
        )
        return out.view(n, hq, d)
    mask = c.mask
    if mask is None:
        k, v = k[:, : c.max_len], v[:, : c.max_len]
    elif mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    if k.dtype != q.dtype:  # a 16-bit cache: attend in the query dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.view(n, hkv, hq // hkv, d), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.view(n, hq, d)


def paged_attention_prefill_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    *,
    plan: list[PrefillSeq] | Callable[[], list[PrefillSeq]] | None = None,
) -> torch.Tensor:
    """CPU form of `pkgd_kernels.paged_attention_prefill_ref` (same arguments and result;
    unchecked), with ``plan`` from `plan_prefill` when the caller has one."""
    if callable(plan):
        plan = plan()
    if plan is None:
        plan = plan_prefill(block_tables, query_start_loc.tolist(), seq_lens.tolist(), key_cache.shape[1])
    out = torch.empty_like(query)
    for seq in plan:
        out[seq.token_start : seq.token_end] = _prefill_one(
            query, key_cache, value_cache, seq, scale, sliding_window, soft_cap
        )
    return out


def _prefill_one(
    q, key_cache, value_cache, seq: PrefillSeq, scale: float, sliding_window: int, soft_cap: float
) -> torch.Tensor:
    hq, d = q.shape[1], q.shape[2]
    hkv = key_cache.shape[2]
    qs = q[seq.token_start : seq.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    ks = key_cache.index_select(0, seq.block_ids).view(-1, hkv, d)[: seq.seq_len].transpose(0, 1).unsqueeze(0)
    vs = value_cache.index_select(0, seq.block_ids).view(-1, hkv, d)[: seq.seq_len].transpose(0, 1).unsqueeze(0)
    if ks.dtype != qs.dtype:  # a 16-bit cache: attend in the query dtype
        ks, vs = ks.to(qs.dtype), vs.to(qs.dtype)
    if qs.shape[2] == 0:
        return q[seq.token_start : seq.token_end].clone()
    # Head-major copies: torch's CPU flash attention in bf16 reads transposed (token-major)
    # views far slower than it makes the copies (measured: a 16 x 128-token bf16 prefill's
    # attention 1.4x faster with them; float32 about the same).
    qs, ks, vs = qs.contiguous(), ks.contiguous(), vs.contiguous()
    if soft_cap or (sliding_window and seq.seq_len > sliding_window):
        n = seq.token_end - seq.token_start
        pos = torch.arange(seq.seq_len - n, seq.seq_len)[:, None]
        key_pos = torch.arange(seq.seq_len)[None, :]
        visible = (key_pos <= pos) & (key_pos > pos - sliding_window) if sliding_window else key_pos <= pos
        return _attend_masked(qs, ks, vs, visible.view(1, 1, n, -1), scale, soft_cap)[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=hq != hkv
    )
    return out[0].transpose(0, 1)


def _attend_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float, soft_cap: float
) -> torch.Tensor:
    """``q [B, Hq, n, D]`` over ``k``/``v [B, Hkv, L, D]`` (one dtype) where ``visible`` (bool,
    broadcast to ``[B, Hq, n, L]``) allows; scores ``c * tanh(s / c)`` when ``soft_cap`` c is
    set (computed in float32, as the references do). Every row must see a key. Returns
    ``[B, Hq, n, D]``, q's dtype."""
    hq, hkv = q.shape[1], k.shape[1]
    if not soft_cap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=hq != hkv)
    if hq != hkv:
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale / soft_cap).tanh_().mul_(soft_cap)
    probs = scores.masked_fill_(visible.logical_not(), float("-inf")).softmax(dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)
