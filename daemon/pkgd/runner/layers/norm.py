"""RMSNorm layer (Zhang & Sennrich, 2019) over `pkgd.runner.ops`."""

from __future__ import annotations

import torch
from torch import nn

from pkgd.runner import ops


class RMSNorm(nn.Module):
    """``weight [H]``; ``forward(x)`` or ``forward(x, residual)`` (fused add, returns both)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
