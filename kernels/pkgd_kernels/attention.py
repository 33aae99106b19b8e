"""Attention over the paged KV cache: decode (one query token per sequence) and varlen prefill
(several query tokens per sequence, causal, after any cached context).

The cache layout and batch metadata are vLLM's (Kwon et al. 2023, "Efficient Memory Management
for Large Language Model Serving with PagedAttention"): ``key_cache``/``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; key ``j`` of sequence ``s`` lives in block
``block_tables[s, j // block_size]`` at offset ``j % block_size``; ``seq_lens[s]`` counts the
sequence's keys including this step's tokens, which ``reshape_and_cache`` has already written.
Grouped-query attention (Ainslie et al. 2023): query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``.

``out[t, h] = softmax(cap(scale * q[t, h] . K[s]^T) over keys 0..pos(t)) @ V[s]``, with softmax
in float32 and the result rounded to the query dtype. Two options every form takes (after ``scale``,
0 = off): ``sliding_window`` W keeps only keys ``j > pos(t) - W``, the last W positions up to
the query's own (Mistral, Gemma 2/3's local layers; transformers' ``sliding_window_overlay``);
``soft_cap`` c makes ``cap(x) = c * tanh(x / c)`` (Gemma 2's attention-logit soft-capping,
Gemma Team 2024), else ``cap(x) = x``. The Triton kernels compute it in one pass
over the keys with FlashAttention's online softmax (Dao et al. 2022; Milakov & Gimelshein 2018);
the references gather the keys densely and take an ordinary softmax. A sequence with no keys
(``seq_lens[s] == 0``, e.g. a padded batch slot) yields zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pkgd_kernels._util import (
    FLOAT_DTYPES,
    check_dtype,
    check_kv_cache,
    check_same,
    check_shape,
    on_device,
    triton_module,
    unit_stride,
    use_triton,
)
from pkgd_kernels.attention_cpu import (
    DecodeChunk,
    PrefillSeq,
    paged_attention_decode_cpu,
    paged_attention_prefill_cpu,
)

_DECODE = "paged_attention_decode"
_PREFILL = "paged_attention_prefill"


def _check_common(
    op: str,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    mixed_cache: bool = False,
) -> None:
    _, _, num_kv_heads, head_dim = check_kv_cache(op, key_cache, value_cache)
    check_shape(op, "query", query, [None, None, head_dim])
    if mixed_cache:  # the CPU forms also take a 16-bit cache under float32 queries
        check_dtype(op, "query", query, FLOAT_DTYPES)
        check_same(op, {"query": query, "key_cache": key_cache}, dtype=False)
    else:
        check_same(op, {"query": query, "key_cache": key_cache})
    if query.shape[1] == 0 or query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"{op}: query heads ({query.shape[1]}) must be a positive multiple of the cache's KV heads ({num_kv_heads})"
        )
    check_shape(op, "block_tables", block_tables, [seq_lens.shape[0], None])
    check_dtype(op, "block_tables", block_tables, [torch.int32])
    check_shape(op, "seq_lens", seq_lens, [None])
    check_dtype(op, "seq_lens", seq_lens, [torch.int32])
    check_same(op, {"query": query, "block_tables": block_tables, "seq_lens": seq_lens}, dtype=False)
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be finite, got {scale}")


def _check_options(op: str, sliding_window: int, soft_cap: float) -> None:
    if sliding_window < 0:
        raise ValueError(f"{op}: sliding_window must be >= 0 (0 = none), got {sliding_window}")
    if not math.isfinite(soft_cap) or soft_cap < 0:
        raise ValueError(f"{op}: soft_cap must be finite and >= 0 (0 = none), got {soft_cap}")


def _check_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, mixed_cache=False) -> None:
    _check_common(_DECODE, query, key_cache, value_cache, block_tables, seq_lens, scale, mixed_cache)
    check_shape(_DECODE, "seq_lens", seq_lens, [query.shape[0]])


def _check_prefill(
    query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, mixed_cache=False
) -> None:
    _check_common(_PREFILL, query, key_cache, value_cache, block_tables, seq_lens, scale, mixed_cache)
    check_shape(_PREFILL, "query_start_loc", query_start_loc, [seq_lens.shape[0] + 1])
    check_dtype(_PREFILL, "query_start_loc", query_start_loc, [torch.int32])
    check_same(_PREFILL, {"query": query, "query_start_loc": query_start_loc}, dtype=False)


def _check_values(
    op: str, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Reference-only value checks: lengths fit the block table, used block ids exist."""
    capacity = block_tables.shape[1] * block_size
    if bool(((seq_lens < 0) | (seq_lens > capacity)).any()):
        raise ValueError(
            f"{op}: seq_lens must lie in [0, {capacity}] (block table width * block_size), got {seq_lens.tolist()}"
        )
    used = torch.arange(block_tables.shape[1], device=seq_lens.device)[None, :] * block_size
    used = used < seq_lens[:, None].long()
    ids = block_tables[used]
    if bool(((ids < 0) | (ids >= num_blocks)).any()):
        raise ValueError(f"{op}: block_tables holds a block id outside [0, {num_blocks}) within seq_lens")


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Keys or values of every sequence, dense: ``[S, max(seq_lens), num_kv_heads, head_dim]``.

    Copies whole blocks (one ``index_select`` of ``block_size`` rows each, ~10x faster on CPU
    than gathering token by token). Positions past a sequence's own length are zero: they
    come through padding entries of the block table or from unwritten slots, whose contents
    (even NaN, in a cache from ``torch.empty``) must not leak into the result.
    """
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    length = int(seq_lens.max()) if seq_lens.numel() else 0
    num_blocks = -(-length // block_size)
    first_pos = torch.arange(num_blocks, device=cache.device) * block_size
    used = first_pos[None, :] < seq_lens[:, None]
    blocks = torch.where(used, block_tables[:, :num_blocks], 0).flatten().long()
    dense = cache.index_select(0, blocks)
    dense = dense.view(num_seqs, num_blocks * block_size, num_kv_heads * head_dim)
    pos = torch.arange(num_blocks * block_size, device=cache.device)
    pad_seq, pad_pos = (pos[None, :] >= seq_lens[:, None]).nonzero(as_tuple=True)
    dense[pad_seq, pad_pos] = 0.0  # writes the padding rows only
    return dense[:, :length].view(num_seqs, length, num_kv_heads, head_dim)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, soft_cap: float = 0.0
) -> torch.Tensor:
    """Masked softmax attention in float32 (scores soft-capped when ``soft_cap``).

    Args:
        q: ``[B, Q, Hq, D]``; k, v: ``[B, L, Hkv, D]``; mask: bool ``[B, Q, L]`` (True = attend).

    Returns:
        ``[B, Q, Hq, D]`` float32; rows with nothing to attend to are zero.

    One batched matmul pair per KV head, on strided views of ``k``/``v``: BLAS reads them in
    place, where a single einsum over all heads would first copy them head-major.
    """
    batch, num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    q, k, v = q.float(), k.float(), v.float()
    hidden = mask.logical_not().repeat_interleave(group, dim=1)  # [B, Q*G, L], rows (q, g)
    out = torch.empty(batch, num_q, num_kv_heads, group, head_dim, device=q.device)
    for h in range(num_kv_heads):
        rows = q[:, :, h * group : (h + 1) * group].reshape(batch, num_q * group, head_dim)
        scores = torch.bmm(rows, k[:, :, h].transpose(1, 2)).mul_(scale)
        if soft_cap:
            scores = scores.div_(soft_cap).tanh_().mul_(soft_cap)
        probs = scores.masked_fill_(hidden, float("-inf")).softmax(dim=-1)
        probs = probs.nan_to_num_(0.0)  # rows with every key hidden -> 0
        out[:, :, h] = torch.bmm(probs, v[:, :, h]).view(batch, num_q, group, head_dim)
    return out.view(batch, num_q, num_heads, head_dim)


def paged_attention_decode_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """Decode attention over the paged cache (PyTorch reference).

    Sequence ``s``'s one query token sits at position ``seq_lens[s] - 1`` and attends to all
    of that sequence's keys (the last ``sliding_window`` of them when that is set).

    Args:
        query: ``[S, num_heads, head_dim]``, the cache's dtype (float32/float16/bfloat16).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: int32 ``[S, max_blocks_per_seq]``; entries past a sequence's length are
            padding (0) and not read.
        seq_lens: int32 ``[S]``, keys per sequence (0 = empty slot, output zeros).
        scale: multiplies ``q . k`` before the softmax, usually ``head_dim ** -0.5``.
        sliding_window, soft_cap: as in the module docstring (0 = off).

    Returns:
        ``[S, num_heads, head_dim]``, query dtype.

    Raises:
        ValueError: shapes, dtypes or devices disagree, ``num_heads`` is not a multiple of
            ``num_kv_heads``, a length exceeds the block table, a used block id is outside
            the cache, or an option is negative.
    """
    _check_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    _check_options(_DECODE, sliding_window, soft_cap)
    _check_values(_DECODE, block_tables, seq_lens, *key_cache.shape[:2])
    keys = _gather(key_cache, block_tables, seq_lens)
    values = _gather(value_cache, block_tables, seq_lens)
    positions = torch.arange(keys.shape[1], device=query.device)
    mask = positions[None, None, :] < seq_lens[:, None, None]
    if sliding_window:
        mask &= positions[None, None, :] >= seq_lens[:, None, None] - sliding_window
    out = _attend(query[:, None], keys, values, mask, scale, soft_cap)
    return out[:, 0].to(query.dtype)


def paged_attention_prefill_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """Causal varlen attention over the paged cache (PyTorch reference).

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s+1]`` (``q_len``
    of them); its row ``i`` sits at position ``seq_lens[s] - q_len + i`` and attends to keys
    ``0..position``: this covers a whole prompt, a chunk of one after cached context (chunked
    prefill, prefix-cache hits) and decode (``q_len == 1``). Single-token sequences are
    batched together; longer ones attend one sequence at a time, so memory stays linear in
    the batch.

    Args:
        query: ``[T, num_heads, head_dim]``, ``T = query_start_loc[-1]``, the cache's dtype.
        key_cache, value_cache, block_tables, scale, sliding_window, soft_cap: as in
            :func:`paged_attention_decode_ref`.
        query_start_loc: int32 ``[S + 1]``, cumulative query lengths from 0.
        seq_lens: int32 ``[S]``, keys per sequence including this step's, >= its ``q_len``.

    Returns:
        ``[T, num_heads, head_dim]``, query dtype.

    Raises:
        ValueError: as :func:`paged_attention_decode_ref`, and when ``query_start_loc`` does
            not run from 0 to ``T`` without decreasing or a ``q_len`` exceeds its ``seq_len``.
    """
    _check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    _check_options(_PREFILL, sliding_window, soft_cap)
    _check_values(_PREFILL, block_tables, seq_lens, *key_cache.shape[:2])
    starts, q_lens = _query_spans(query_start_loc, seq_lens, query.shape[0])
    out = torch.empty_like(query)
    single = [s for s, q in enumerate(q_lens) if q == 1]
    if single:
        rows = query_start_loc[single].long()
        index = torch.tensor(single, device=query.device)
        out[rows] = paged_attention_decode_ref(
            query[rows], key_cache, value_cache, block_tables[index], seq_lens[index], scale,
            sliding_window=sliding_window, soft_cap=soft_cap,
        )  # fmt: skip
    for s, (start, q_len) in enumerate(zip(starts, q_lens)):
        if q_len > 1:
            keys = _gather(key_cache, block_tables[s : s + 1], seq_lens[s : s + 1])
            values = _gather(value_cache, block_tables[s : s + 1], seq_lens[s : s + 1])
            length = keys.shape[1]
            pos = torch.arange(length - q_len, length, device=query.device)
            key_pos = torch.arange(length, device=query.device)[None, :]
            mask = key_pos <= pos[:, None]
            if sliding_window:
                mask &= key_pos > pos[:, None] - sliding_window
            rows = query[None, start : start + q_len]
            out[start : start + q_len] = _attend(rows, keys, values, mask[None], scale, soft_cap)[0]
    return out


def _query_spans(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> tuple[list[int], list[int]]:
    """Each sequence's first query row and query length, checked against ``T`` and its keys."""
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    if starts[0] != 0 or starts[-1] != num_tokens or min(q_lens, default=0) < 0:
        raise ValueError(f"{_PREFILL}: query_start_loc must rise from 0 to T={num_tokens}, got {starts}")
    lens = seq_lens.tolist()
    if any(q > n for q, n in zip(q_lens, lens)):
        raise ValueError(f"{_PREFILL}: a sequence has more query tokens than keys: q_lens {q_lens}, seq_lens {lens}")
    return starts[:-1], q_lens


def paged_attention_decode_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """Triton version of :func:`paged_attention_decode_ref` (same arguments and result).

    One program per (sequence, KV head) serves all the query heads that share the KV head, so
    each key and value is read once per group; long contexts are split into partitions whose
    partial softmax states a second kernel merges (vLLM's paged attention v2 / flash-decoding).

    Raises:
        ValueError: shapes, dtypes or devices disagree (values are not checked: that would
            need a device sync).
    """
    _check_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    _check_options(_DECODE, sliding_window, soft_cap)
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] > 0:
        with on_device(query):
            triton_module("attention_decode_triton").launch_decode(
                query,
                key_cache,
                value_cache,
                unit_stride(block_tables),
                unit_stride(seq_lens),
                scale,
                out,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
            )
    return out


def paged_attention_prefill_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """Triton version of :func:`paged_attention_prefill_ref` (same arguments and result).

    One program per (tile of a sequence's query rows, query head) sweeps that sequence's keys
    up to the tile's last position, FlashAttention-style; the grid covers ``T // BLOCK_M + S``
    tiles so no host sync is needed, and each program finds its sequence by binary search
    over ``query_start_loc`` (as vLLM's unified Triton attention does).

    Raises:
        ValueError: shapes, dtypes or devices disagree (values are not checked).
    """
    _check_prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    _check_options(_PREFILL, sliding_window, soft_cap)
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if query.shape[0] > 0:
        with on_device(query):
            triton_module("attention_prefill_triton").launch_prefill(
                query,
                key_cache,
                value_cache,
                unit_stride(block_tables),
                unit_stride(query_start_loc),
                unit_stride(seq_lens),
                scale,
                out,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
            )
    return out


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    *,
    kernels=None,
    plan: list[DecodeChunk] | Callable[[], list[DecodeChunk]] | None = None,
) -> torch.Tensor:
    """Decode attention over the paged KV cache: :func:`paged_attention_decode_triton` on CUDA
    tensors; on CPU the C form when ``kernels`` (a `pkgd_kernels.cpu.CpuKernels`) takes the
    tensors, else `paged_attention_decode_cpu` with ``plan`` (see
    :func:`paged_attention_decode_ref` for shapes and errors; on CPU the cache may also be
    16-bit under float32 queries). The C form has neither option: it runs only where they
    change nothing (no soft cap, no sequence longer than the window)."""
    args = (query, key_cache, value_cache, block_tables, seq_lens, scale)
    if use_triton(query):
        return paged_attention_decode_triton(*args, sliding_window, soft_cap)
    _check_decode(*args, mixed_cache=True)
    _check_options(_DECODE, sliding_window, soft_cap)
    if (
        kernels is not None
        and not soft_cap
        and not (sliding_window and seq_lens.numel() and int(seq_lens.max()) > sliding_window)
        and kernels.takes_paged_attention_decode(query, key_cache)
    ):
        return kernels.paged_attention_decode(*args)
    return paged_attention_decode_cpu(*args, sliding_window, soft_cap, plan=plan)


def paged_attention_prefill(
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
    """Causal varlen attention over the paged KV cache: :func:`paged_attention_prefill_triton`
    on CUDA tensors, `paged_attention_prefill_cpu` with ``plan`` otherwise (see
    :func:`paged_attention_prefill_ref` for shapes and errors; on CPU the cache may also be
    16-bit under float32 queries)."""
    args = (query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    if use_triton(query):
        return paged_attention_prefill_triton(*args, sliding_window, soft_cap)
    _check_prefill(*args, mixed_cache=True)
    _check_options(_PREFILL, sliding_window, soft_cap)
    return paged_attention_prefill_cpu(*args, sliding_window, soft_cap, plan=plan)
