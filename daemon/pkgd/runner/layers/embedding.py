"""Vocabulary-parallel token embedding and LM head (Megatron-LM's vocab split).

Rank r holds vocabulary rows ``[r * V/tp, (r+1) * V/tp)``. The LM head weight is stored
``[H, V/tp]`` (applied as ``h @ W``, the fast layout at small batches, see `layers.linear`);
with tied embeddings (``tie_word_embeddings``) the embedding lookup reads the same tensor
column-wise, so the 28M-parameter matrix of SmolLM2 is held once.
"""

from __future__ import annotations

import torch
from torch import nn

from pkgd.runner.distributed import SINGLE, TPGroup


class VocabParallelEmbedding(nn.Module):
    """Token ids ``[T]`` (int64) -> ``[T, H]``. ``weight`` is ``[V/tp, H]``, or, when
    ``transposed_weight`` is given (tied LM head), that ``[H, V/tp]`` tensor is used instead."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32, transposed_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local = tp.shard(vocab_size, "vocab_size")
        self.start = tp.rank * self.local
        self.transposed = transposed_weight
        self.weight = None
        if transposed_weight is None:
            self.weight = nn.Parameter(torch.empty(self.local, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_ids, mask = ids, None
        if self.tp.size > 1:
            mask = (ids < self.start) | (ids >= self.start + self.local)
            local_ids = (ids - self.start).masked_fill(mask, 0)
        if self.transposed is not None:
            out = self.transposed.index_select(1, local_ids).t().contiguous()
        else:
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
            raise ValueError(f"embedding: checkpoint shape {tuple(weight.shape)} does not match ({self.vocab_size}, {self.weight.shape[1]})")
        self.weight.copy_(rows)


class ParallelLMHead(nn.Module):
    """``h [N, H] -> logits [N, V]`` (gathered over ranks). ``weight`` is ``[H, V/tp]``."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp = tp
        self.local = tp.shard(vocab_size, "vocab_size")
        self.start = tp.rank * self.local
        self.weight = nn.Parameter(torch.empty(hidden_size, self.local, dtype=dtype), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(h @ self.weight, dim=-1)

    def load(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full HF ``[V, H]`` weight (embedding or lm_head)."""
        rows = weight[self.start : self.start + self.local].t()
        if rows.shape != self.weight.shape:
            raise ValueError(f"lm_head: checkpoint shape {tuple(weight.shape)} does not match the model's")
        self.weight.copy_(rows)
