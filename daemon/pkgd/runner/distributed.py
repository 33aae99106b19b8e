"""Tensor-parallel group of one model replica (torch.distributed; gloo on CPU, NCCL on GPU).

The process owner (a TP worker) calls `torch.distributed.init_process_group` before building
the model; layers only call `TPGroup.all_reduce` / `all_gather`, which are no-ops when the
group has one rank, so a single-process runner never touches torch.distributed.
"""

from __future__ import annotations

import dataclasses

import torch

from pkgd.config.errors import ModelConfigMismatch


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group (``rank`` in ``[0, size)``).
    ``expert_parallel`` (``parallel.enable_expert_parallel``): MoE layers split their experts
    across the group instead of each expert's features (`pkgd.runner.layers.moe`)."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` becomes rank 0's, in place; returns ``x``."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=0)
        return x

    def shard(self, total: int, what: str) -> int:
        """``total // size``; raises `ModelConfigMismatch` naming ``what`` when it does not divide."""
        if total % self.size:
            raise ModelConfigMismatch(
                f"parallel.tp: {what} ({total}) is not divisible by the tensor-parallel size ({self.size}); "
                "choose a tensor-parallel size that divides it"
            )
        return total // self.size


SINGLE = TPGroup()
