"""RMSNorm layer (Zhang & Sennrich, 2019) over ``pkgd_kernels.rms_norm``."""

from __future__ import annotations

import torch
from torch import nn

import pkgd_kernels as pk


class RMSNorm(nn.Module):
    """``weight [H]``; ``forward(x)`` or ``forward(x, residual)`` (fused add, returns both).
    ``kernels``: the model's `pkgd_kernels.cpu.CpuKernels` (or None), for the ops' C forms."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32, kernels=None) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return pk.rms_norm(x, self.weight, self.eps, kernels=self.kernels)
        return pk.fused_add_rms_norm(x, residual, self.weight, self.eps, kernels=self.kernels)
