"""Attention over the paged KV cache: batch metadata, the CPU path, and CUDA dispatch.

Cache layout (shared with ``pkgd_kernels``): per layer ``key_cache`` and ``value_cache``, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype; the slot of a token is
``block_id * block_size + offset_in_block``. A flattened batch puts **decode sequences first**
(one query token each), then prefill / chunked-prefill sequences, so each group is one
contiguous token range and maps to one kernel call.

CPU path (DESIGN.md §5):

* decode, when the C kernels are loaded (`pkgd.runner.ops.cpu_kernels`): one call per layer
  reads each sequence's K/V in place through its block table (``pkgd_kernels.cpu``), no
  gathered copies. Otherwise (plain PyTorch): sequences are processed in chunks whose
  gathered K/V (``index_select`` of whole blocks) stays about 1 MB, so it is re-read from
  cache rather than DRAM and every temporary stays under the engine's 1 MiB mmap threshold
  (`pkgd.runner.allocator`; a fresh mmapped buffer per layer costs more in page faults than
  the attention itself). Each chunk is one ``scaled_dot_product_attention`` call
  with an additive length mask (none when the chunk's lengths are equal), the query heads of
  each KV head grouped as that head's queries.
* prefill: per sequence. A prompt with no cached context attends to its own fresh K/V
  (``is_causal``); a chunk with cached context gathers its blocks and uses an explicit causal
  mask aligned bottom-right (query i sits at position ``seq_len - q_len + i``).

GQA: query head h reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from pkgd_kernels.cpu import supports_decode

from pkgd.runner import ops
from pkgd.runner.ops import kernels

# One layer's paged KV cache: (key cache, value cache), each
# [num_blocks, block_size, num_kv_heads, head_dim].
KVCache = tuple[torch.Tensor, torch.Tensor]

# Bytes of gathered K+V per decode chunk on CPU (fits in L2 beside the weights' stream; K and
# V each stay under the 1 MiB mmap threshold of `pkgd.runner.allocator`).
DECODE_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass
class PrefillSeq:
    """One prefill sequence of a step, with what the CPU path needs precomputed."""

    token_start: int  # first query token in the flattened batch
    token_end: int
    seq_len: int  # context length including this step's tokens
    block_ids: torch.Tensor | None  # int64 [ceil(seq_len / block_size)]; None when no context
    mask: torch.Tensor | None  # bool [1, 1, q_len, seq_len]; None when no context (is_causal)


@dataclasses.dataclass
class DecodeChunk:
    """Decode sequences ``[seq_start, seq_end)`` gathered together on CPU."""

    seq_start: int
    seq_end: int
    block_ids: torch.Tensor  # int64 [(seq_end - seq_start) * num_blocks]
    mask: torch.Tensor | None  # float32 additive (0 / -inf) [n, 1, 1, num_blocks * block_size]
    max_len: int  # longest sequence; with no mask, every sequence has this length


@dataclasses.dataclass
class AttentionMetadata:
    """The flattened batch as attention sees it (contract in the module docstring).

    Tensors: ``slot_mapping`` int64 ``[T]`` (-1 = do not write), ``block_tables`` int32
    ``[S, max_blocks]`` (padding 0), ``seq_lens`` int32 ``[S]``, ``query_start_loc`` int32
    ``[S + 1]``. The first ``num_decodes`` sequences have one query token each.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_decodes: int
    num_tokens: int
    block_size: int
    prefills: list[PrefillSeq]
    kv_bytes_per_token: int = 0
    _decode_chunks: list[DecodeChunk] | None = None

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @classmethod
    def build(
        cls,
        *,
        query_lens: list[int],
        seq_lens: list[int],
        block_table_rows: list[list[int]],
        slot_mapping: torch.Tensor,
        block_size: int,
        kv_bytes_per_token: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Build from host lists. Sequences with ``query_len == 1`` (decodes, and prefill chunks
        of one token, which attend the same way) must come first.

        ``kv_bytes_per_token`` (K+V of one layer) sizes the CPU decode chunks.
        """
        num_seqs = len(query_lens)
        num_decodes = 0
        while num_decodes < num_seqs and query_lens[num_decodes] == 1:
            num_decodes += 1
        max_blocks = max((len(r) for r in block_table_rows), default=0) or 1
        table = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
        for i, row in enumerate(block_table_rows):
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        meta = cls(
            slot_mapping=slot_mapping.to(device),
            block_tables=table.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            num_decodes=num_decodes,
            num_tokens=qsl[-1],
            block_size=block_size,
            prefills=[],
            kv_bytes_per_token=kv_bytes_per_token,
        )
        if device.type == "cpu":
            meta.prefills = _prefill_seqs(table, query_lens, seq_lens, qsl, num_decodes, block_size)
        return meta

    @property
    def decode_chunks(self) -> list[DecodeChunk]:
        """The PyTorch CPU decode path's chunks (computed on first use, once per step)."""
        if self._decode_chunks is None:
            nd = self.num_decodes
            self._decode_chunks = _decode_chunks(self.block_tables[:nd], self.seq_lens[:nd].tolist(), self.block_size, self.kv_bytes_per_token)
        return self._decode_chunks


def _decode_chunks(table: torch.Tensor, seq_lens: list[int], block_size: int, kv_bytes_per_token: int) -> list[DecodeChunk]:
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
        ids = table[start:end, :nb].to(torch.int64).reshape(-1)
        lens = seq_lens[start:end]
        if min(lens) == longest:  # equal lengths: slice the gathered K/V, no mask
            chunks.append(DecodeChunk(start, end, ids, None, longest))
        else:  # additive mask: SDPA would convert a boolean one on every call
            mask = torch.zeros(end - start, nb * block_size)
            mask.masked_fill_(torch.arange(nb * block_size)[None, :] >= torch.tensor(lens)[:, None], float("-inf"))
            chunks.append(DecodeChunk(start, end, ids, mask.view(end - start, 1, 1, -1), longest))
        start = end
    return chunks


def _prefill_seqs(table: torch.Tensor, query_lens: list[int], seq_lens: list[int], qsl: list[int], first: int, block_size: int) -> list[PrefillSeq]:
    out = []
    for i in range(first, len(query_lens)):
        q_len, seq_len = query_lens[i], seq_lens[i]
        ctx = seq_len - q_len
        ids = mask = None
        if ctx > 0:
            ids = table[i, : -(-seq_len // block_size)].to(torch.int64)
            pos = torch.arange(ctx, seq_len)
            mask = (torch.arange(seq_len)[None, :] <= pos[:, None]).view(1, 1, q_len, seq_len)
        out.append(PrefillSeq(qsl[i], qsl[i + 1], seq_len, ids, mask))
    return out


# ---- ops to the shared kernel signatures ---------------------------------------------------


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value [T, Hkv, D]`` into the caches at ``slot_mapping`` (int64 ``[T]``;
    -1 skips the token). In place."""
    if key.is_cuda:
        kernels().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    _write_cache(key, value, key_cache, value_cache, slot_mapping)


def _write_cache(key, value, key_cache, value_cache, slots) -> None:
    nb, bs, h, d = key_cache.shape
    if key.dtype != key_cache.dtype:  # a 16-bit cache under a float32 model (cache.cache_dtype)
        key, value = key.to(key_cache.dtype), value.to(key_cache.dtype)
    key_cache.view(nb * bs, h, d).index_copy_(0, slots, key)
    value_cache.view(nb * bs, h, d).index_copy_(0, slots, value)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence (``query [S, Hq, D]``, at position ``seq_lens[s] - 1``)
    attending to its first ``seq_lens[s]`` cached tokens. Returns ``[S, Hq, D]``."""
    if query.is_cuda:
        return kernels().paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    out = _decode_c(query, key_cache, value_cache, block_tables, seq_lens, scale)
    if out is not None:
        return out
    _, bs, hkv, d = key_cache.shape
    chunks = _decode_chunks(block_tables.cpu(), seq_lens.tolist(), bs, 2 * hkv * d * max(key_cache.element_size(), query.element_size()))
    return _decode_cpu(query, key_cache, value_cache, chunks, scale)


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``query [T, Hq, D]`` over the cache (which already holds this
    step's K/V). Query token i of sequence s sits at position ``seq_lens[s] - q_len_s + i`` and
    attends to keys ``0..position``. Returns ``[T, Hq, D]``."""
    if query.is_cuda:
        return kernels().paged_attention_prefill(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
    bs = key_cache.shape[1]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out = torch.empty_like(query)
    for s in range(len(lens)):
        ctx_mask_len = lens[s]
        q_len = qsl[s + 1] - qsl[s]
        pos = torch.arange(ctx_mask_len - q_len, ctx_mask_len)
        mask = (torch.arange(ctx_mask_len)[None, :] <= pos[:, None]).view(1, 1, q_len, ctx_mask_len)
        ids = block_tables[s, : -(-ctx_mask_len // bs)].to(torch.int64)
        seq = PrefillSeq(qsl[s], qsl[s + 1], ctx_mask_len, ids, mask)
        out[qsl[s] : qsl[s + 1]] = _prefill_one(query, None, None, key_cache, value_cache, seq, scale)
    return out


# ---- the layer-facing entry point -----------------------------------------------------------


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's ``k``/``v [T, Hkv, D]`` into ``kv_cache`` and attend with
    ``q [T, Hq, D]``; returns ``[T, Hq, D]``."""
    key_cache, value_cache = kv_cache
    nd = meta.num_decodes
    if q.is_cuda:
        reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = paged_attention_decode(q[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        if meta.num_tokens > nd:
            qsl = meta.query_start_loc[nd:] - meta.query_start_loc[nd]
            out[nd:] = paged_attention_prefill(q[nd:], key_cache, value_cache, meta.block_tables[nd:], qsl, meta.seq_lens[nd:], scale)
        return out
    _write_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    if not meta.prefills:
        return _decode_step(q, key_cache, value_cache, meta, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode_step(q[:nd], key_cache, value_cache, meta, scale)
    for seq in meta.prefills:
        out[seq.token_start : seq.token_end] = _prefill_one(q, k, v, key_cache, value_cache, seq, scale)
    return out


def _decode_step(q, key_cache, value_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The decode sequences of a step (``q [num_decodes, Hq, D]``) on CPU."""
    nd = meta.num_decodes
    out = _decode_c(q, key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
    return out if out is not None else _decode_cpu(q, key_cache, value_cache, meta.decode_chunks, scale)


def _decode_c(q, key_cache, value_cache, block_tables, seq_lens, scale: float) -> torch.Tensor | None:
    """Decode attention through the C kernel, or None when it is not loaded or does not take
    these tensors (the caller then uses the PyTorch path)."""
    cpu = ops.cpu_kernels()
    if cpu is None or not supports_decode(q, key_cache):
        return None
    return cpu.paged_attention_decode(q, key_cache, value_cache, block_tables, seq_lens, scale)


def _decode_cpu(q, key_cache, value_cache, chunks: list[DecodeChunk], scale: float) -> torch.Tensor:
    _, bs, hkv, d = key_cache.shape
    hq = q.shape[1]
    if len(chunks) == 1:
        return _decode_chunk(q, key_cache, value_cache, chunks[0], scale, hq, hkv, d)
    out = torch.empty_like(q)
    for c in chunks:
        out[c.seq_start : c.seq_end] = _decode_chunk(q[c.seq_start : c.seq_end], key_cache, value_cache, c, scale, hq, hkv, d)
    return out


def _decode_chunk(q, key_cache, value_cache, c: DecodeChunk, scale, hq, hkv, d) -> torch.Tensor:
    n = c.seq_end - c.seq_start
    k = key_cache.index_select(0, c.block_ids).view(n, -1, hkv, d)
    v = value_cache.index_select(0, c.block_ids).view(n, -1, hkv, d)
    mask = c.mask
    if mask is None:
        k, v = k[:, : c.max_len], v[:, : c.max_len]
    elif mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    if k.dtype != q.dtype:  # a 16-bit cache: attend in the model dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
    # The G = Hq/Hkv query heads of a KV head act as G queries against that head's K/V: one
    # read of K/V serves them all (~10% faster than enable_gqa with one query per head).
    out = F.scaled_dot_product_attention(q.view(n, hkv, hq // hkv, d), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.view(n, hq, d)


def _prefill_one(q, k, v, key_cache, value_cache, seq: PrefillSeq, scale: float) -> torch.Tensor:
    hq, d = q.shape[1], q.shape[2]
    qs = q[seq.token_start : seq.token_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    if seq.block_ids is None:  # no cached context: attend to the fresh K/V
        ks = k[seq.token_start : seq.token_end].transpose(0, 1).unsqueeze(0)
        vs = v[seq.token_start : seq.token_end].transpose(0, 1).unsqueeze(0)
        causal, mask = True, None
    else:
        hkv = key_cache.shape[2]
        ks = key_cache.index_select(0, seq.block_ids).view(-1, hkv, d)[: seq.seq_len].transpose(0, 1).unsqueeze(0)
        vs = value_cache.index_select(0, seq.block_ids).view(-1, hkv, d)[: seq.seq_len].transpose(0, 1).unsqueeze(0)
        causal, mask = False, seq.mask
        if ks.dtype != qs.dtype:  # a 16-bit cache: attend in the model dtype
            ks, vs = ks.to(qs.dtype), vs.to(qs.dtype)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=hq != ks.shape[1])
    return out[0].transpose(0, 1)
