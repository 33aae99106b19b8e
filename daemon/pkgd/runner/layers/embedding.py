"""Vocabulary-parallel token embedding and LM head (Megatron-LM's vocab split).

Rank r holds vocabulary rows ``[r * V/tp, (r+1) * V/tp)``. The LM head weight is stored
``[H, V/tp]`` (applied as ``h @ W``, the fast layout at small batches, see `layers.linear`);
with tied embeddings (``tie_word_embeddings``) the embedding lookup reads the LM head's
tensor (`ParallelLMHead.embedding_rows`), so the 28M-parameter matrix of SmolLM2 is held once.

On CPU the float32 LM head is repacked for oneDNN after loading like the other linears
(`pkgd.runner.layers.linear`), with the C GEMV for a few rows: its batched logits were the
slowest GEMM of a decode step (MKL ~95 GFLOP/s at 64 rows against oneDNN's ~190). A tied head
is packed only when the packing's layout is the known ``[V/64][H][64]``, which the embedding
then reads through ``pkgd_kernels.gather_packed`` (its C form when loaded: one float per
64-byte line, so the lines are prefetched together rather than missed one by one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import pkgd_kernels as pk
from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.layers.linear import onednn_linear, pack_for_onednn, packed_view, small_batch_gemv


class VocabParallelEmbedding(nn.Module):
    """Token ids ``[T]`` (int64) -> ``[T, H]``. ``weight`` is ``[V/tp, H]``, or, when
    ``tied_rows`` is given (a tied LM head's `ParallelLMHead.embedding_rows`), rows come
    from it instead."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
        tied_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local = tp.shard(vocab_size, "vocab_size")
        self.start = tp.rank * self.local
        self.tied_rows = tied_rows
        self.weight = None
        if tied_rows is None:
            self.weight = nn.Parameter(torch.empty(self.local, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_ids, mask = ids, None
        if self.tp.size > 1:
            mask = (ids < self.start) | (ids >= self.start + self.local)
            local_ids = (ids - self.start).masked_fill(mask, 0)
        if self.tied_rows is not None:
            out = self.tied_rows(local_ids)
        else:
            assert self.weight is not None  # set when there are no tied rows
            out = self.weight.index_select(0, local_ids)
        if mask is not None:
            out.masked_fill_(mask.unsqueeze(-1), 0)
            self.tp.all_reduce(out)
        return out

    def load(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full ``[V, H]`` embedding."""
        rows = weight[self.start : self.start + self.local]
        if self.weight is None:
            raise ValueError("embedding is tied to the LM head; load the LM head instead")
        if rows.shape != self.weight.shape:
            raise ValueError(
                f"embedding: checkpoint shape {tuple(weight.shape)} does not match ({self.vocab_size}, "
                f"{self.weight.shape[1]})"
            )
        self.weight.copy_(rows)


class ParallelLMHead(nn.Module):
    """``h [N, H] -> logits [N, V]`` (gathered over ranks). ``weight`` is ``[H, V/tp]``, or
    its oneDNN packing after `process_weights_after_loading` on CPU (module docstring).
    ``kernels``: the model's `pkgd_kernels.cpu.CpuKernels` (or None)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
        tied: bool = False,
        kernels=None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.kernels = kernels
        self.tied = tied
        self.local = tp.shard(vocab_size, "vocab_size")
        self.start = tp.rank * self.local
        self.in_features, self.out_features = hidden_size, self.local
        self.weight = nn.Parameter(torch.empty(hidden_size, self.local, dtype=dtype), requires_grad=False)
        self.packed = False
        self.gemv_weight: torch.Tensor | None = None  # [V/64, H, 64] over the packed buffer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.packed:
            logits = small_batch_gemv(self, h, None)
            if logits is None:
                logits = onednn_linear(h, self.weight, None)
        else:
            logits = h @ self.weight
        return self.tp.all_gather(logits, dim=-1)

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (local int64 ``[T]``) of the ``[V/tp, H]`` matrix, as ``[T, H]``."""
        if self.gemv_weight is not None:
            return pk.gather_packed(self.gemv_weight, ids, kernels=self.kernels)
        return self.weight.index_select(1, ids).t().contiguous()

    def process_weights_after_loading(self) -> None:
        """Repack for oneDNN on CPU (float32), unless tied and the layout is not the one the
        embedding can read; no-op elsewhere."""
        if self.packed:
            return
        packed = pack_for_onednn(self.weight.t())
        if packed is None:
            return
        view = packed_view(packed, self.local, self.in_features)
        if self.tied and view is None:
            return  # the embedding could not read the packed rows
        self.gemv_weight = view
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True

    def load(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full HF ``[V, H]`` weight (embedding or lm_head)."""
        if self.packed:
            raise RuntimeError("lm_head: weights are already packed; load before process_weights_after_loading")
        rows = weight[self.start : self.start + self.local].t()
        if rows.shape != self.weight.shape:
            raise ValueError(f"lm_head: checkpoint shape {tuple(weight.shape)} does not match the model's")
        self.weight.copy_(rows)
