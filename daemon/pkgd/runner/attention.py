"""Attention over the paged KV cache as a layer sees it: the step's batch metadata, and one
entry point that writes the step's K/V and attends through the ``pkgd_kernels`` ops.

Cache layout (shared with ``pkgd_kernels``): per layer ``key_cache`` and ``value_cache``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``; the slot of a token is
``block_id * block_size + offset_in_block``. A flattened batch puts **decode sequences first**
(one query token each), then prefill / chunked-prefill sequences, so each group is one
contiguous token range and maps to one kernel call. Which implementation runs (Triton on CUDA,
the C kernels or PyTorch on CPU) is the ops' business; on CPU the metadata also carries the
per-step plans the PyTorch forms reuse in every layer (`pkgd_kernels.attention_cpu`).

GQA: query head h reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import pkgd_kernels as pk
from pkgd_kernels.attention_cpu import DecodeChunk, PrefillSeq, plan_decode, plan_prefill

# One layer's paged KV cache: (key cache, value cache), each
# [num_blocks, block_size, num_kv_heads, head_dim].
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class AttentionMetadata:
    """The flattened batch as attention sees it (contract in the module docstring).

    Tensors: ``slot_mapping`` int64 ``[T]`` (-1 = do not write), ``block_tables`` int32
    ``[S, max_blocks]`` (padding 0), ``seq_lens`` int32 ``[S]``, ``query_start_loc`` int32
    ``[S + 1]``. The first ``num_decodes`` sequences have one query token each.
    ``kv_bytes_per_token`` (K+V of one layer, as attended) sizes the CPU decode chunks.
    ``shares_sequences``: some one-token sequences are consecutive positions of one request
    (speculative verification: its last token and its proposals, each attending the positions
    before it); the step's K/V must all be written before any attention reads it, which
    `paged_attention` always does.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_decodes: int
    num_tokens: int
    block_size: int
    kv_bytes_per_token: int = 0
    shares_sequences: bool = False
    _decode_plan: list[DecodeChunk] | None = dataclasses.field(default=None, repr=False)
    _prefill_plan: list[PrefillSeq] | None = dataclasses.field(default=None, repr=False)

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
        shares_sequences: bool = False,
    ) -> AttentionMetadata:
        """Build from host lists. Sequences with ``query_len == 1`` (decodes, and prefill chunks
        of one token, which attend the same way) must come first."""
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
        return cls(
            slot_mapping=slot_mapping.to(device),
            block_tables=table.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            num_decodes=num_decodes,
            num_tokens=qsl[-1],
            block_size=block_size,
            kv_bytes_per_token=kv_bytes_per_token,
            shares_sequences=shares_sequences,
        )

    @functools.cached_property
    def prefill_query_start_loc(self) -> torch.Tensor:
        """``query_start_loc`` of the prefill sequences, from 0 (int32 ``[S - num_decodes + 1]``)."""
        nd = self.num_decodes
        return self.query_start_loc[nd:] - self.query_start_loc[nd]

    def decode_plan(self) -> list[DecodeChunk]:
        """The CPU PyTorch decode chunks of this step, built on the first call (only when that
        form runs: a step the C kernel serves never builds them), then shared by every layer."""
        if self._decode_plan is None:
            nd = self.num_decodes
            self._decode_plan = plan_decode(
                self.block_tables[:nd], self.seq_lens[:nd].tolist(), self.block_size, self.kv_bytes_per_token
            )
        return self._decode_plan

    def prefill_plan(self) -> list[PrefillSeq]:
        """The CPU per-sequence prefill gathers and masks of this step, built on the first call."""
        if self._prefill_plan is None:
            nd = self.num_decodes
            self._prefill_plan = plan_prefill(
                self.block_tables[nd:],
                self.prefill_query_start_loc.tolist(),
                self.seq_lens[nd:].tolist(),
                self.block_size,
            )
        return self._prefill_plan


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    kernels=None,
    *,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """Write this step's ``k``/``v [T, Hkv, D]`` into ``kv_cache`` and attend with
    ``q [T, Hq, D]``; returns ``[T, Hq, D]``. ``kernels``: the model's
    `pkgd_kernels.cpu.CpuKernels`, or None. ``sliding_window`` (keys within the last W
    positions) and ``soft_cap`` (``c * tanh(score / c)``): the layer's, 0 = none (see
    `pkgd_kernels.attention`)."""
    key_cache, value_cache = kv_cache
    nd = meta.num_decodes
    pk.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    decode = None
    if nd:
        decode = pk.paged_attention_decode(
            q[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
            sliding_window=sliding_window, soft_cap=soft_cap,
            kernels=kernels, plan=meta.decode_plan,  # built only if the PyTorch form runs
        )  # fmt: skip
        if nd == meta.num_tokens:
            return decode
    out = torch.empty_like(q)
    if decode is not None:
        out[:nd] = decode
    out[nd:] = pk.paged_attention_prefill(
        q[nd:], key_cache, value_cache, meta.block_tables[nd:], meta.prefill_query_start_loc, meta.seq_lens[nd:], scale,
        sliding_window=sliding_window, soft_cap=soft_cap, plan=meta.prefill_plan,
    )  # fmt: skip
    return out
