"""The small dense ops of a decoder layer, to the signatures shared with ``pkgd_kernels``.

Each function here is the CPU path (plain PyTorch, written for speed on CPU) and dispatches
to the ``pkgd_kernels`` op of the same name when its input lives on CUDA (Triton kernels,
DESIGN.md §7). Signatures and semantics are those of the shared kernel contract:

* `rms_norm`: ``x [T, H], weight [H] -> [T, H]``, RMSNorm (Zhang & Sennrich, 2019) computed
  in float32 and cast back, as transformers' ``LlamaRMSNorm``.
* `fused_add_rms_norm`: ``(x, residual) -> (rms_norm(x + residual), x + residual)``.
* `silu_and_mul`: ``x [T, 2I] -> silu(x[:, :I]) * x[:, I:]`` (SwiGLU, Shazeer 2020).
* `rotary_embedding`: RoPE (Su et al., 2021) from a ``[max_position, rot_dim]`` cos|sin cache.

On CPU three loops go to C kernels when this host can build them (`enable_cpu_kernels`, called
by the runner before loading weights; `cpu_kernels` returns them or None): small-batch
linears on the packed weights, paged decode attention and float32 RMSNorm
(``pkgd_kernels.cpu``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F


@functools.cache
def kernels() -> ModuleType:
    """The ``pkgd_kernels`` package (Triton kernels); imported on first CUDA use only.

    Raises:
        RuntimeError: it is not installed/importable while a CUDA tensor needs it.
    """
    try:
        import pkgd_kernels
    except ImportError as e:  # pragma: no cover - only on CUDA machines
        raise RuntimeError(f"running on CUDA needs the pkgd_kernels package: {e}") from e
    return pkgd_kernels


_cpu_kernels = None


def enable_cpu_kernels(cache_dir: Path) -> str | None:
    """Build/load ``pkgd_kernels.cpu`` for this process (library cached under ``cache_dir``).

    Returns None when they are in use, else why not (the caller logs it; the PyTorch path
    stays). Idempotent."""
    global _cpu_kernels
    from pkgd_kernels import cpu

    try:
        _cpu_kernels = cpu.load(cache_dir)
    except cpu.CpuKernelsUnavailable as e:
        _cpu_kernels = None
        return str(e)
    return None


def disable_cpu_kernels() -> None:
    """Back to the plain-PyTorch CPU path (tests compare the two)."""
    global _cpu_kernels
    _cpu_kernels = None


def cpu_kernels():
    """The loaded `pkgd_kernels.cpu.CpuKernels`, or None."""
    return _cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x [T, H]`` scaled by ``weight [H]``; same dtype as ``x``."""
    if x.is_cuda:
        return kernels().rms_norm(x, weight, eps)
    if _cpu_kernels is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
        return _cpu_kernels.rms_norm(x, weight, eps)[0]
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual``; returns ``(rms_norm(new_residual), new_residual)``."""
    if x.is_cuda:
        return kernels().fused_add_rms_norm(x, residual, weight, eps)
    if _cpu_kernels is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
        return _cpu_kernels.rms_norm(x, weight, eps, residual)
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I] -> silu(x[:, :I]) * x[:, I:]``, ``[T, I]``."""
    if x.is_cuda:
        return kernels().silu_and_mul(x)
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]).mul_(x[..., half:])


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query [T, Hq*D]`` and ``key [T, Hkv*D]`` by ``positions`` (int64 ``[T]``).

    ``cos_sin_cache [max_position, rot_dim]`` holds cos in its first ``rot_dim/2`` columns and
    sin in the rest; only the first ``rot_dim`` of each head's ``head_size`` rotate.
    ``is_neox`` pairs element i with ``i + rot_dim/2`` (GPT-NeoX / HF rotate-half), otherwise
    adjacent pairs (GPT-J). Returns new tensors of the input shapes.
    """
    if query.is_cuda:
        return kernels().rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    cos, sin = cos_sin_for(positions, cos_sin_cache, query.dtype)
    rot_dim = cos_sin_cache.shape[-1]
    q = apply_rotary(query.view(query.shape[0], -1, head_size), cos, sin, rot_dim, is_neox)
    k = apply_rotary(key.view(key.shape[0], -1, head_size), cos, sin, rot_dim, is_neox)
    return q.reshape(query.shape), k.reshape(key.shape)


def cos_sin_for(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[T, 1, rot_dim/2]`` in ``dtype``, for int64 ``positions [T]``.

    Computed once per forward and shared by every layer.
    """
    cs = cos_sin_cache.index_select(0, positions).to(dtype)
    cos, sin = cs.chunk(2, dim=-1)
    return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int, is_neox: bool
) -> torch.Tensor:
    """Rotate heads ``x [T, H, D]`` (any strides) with ``cos``/``sin [T, 1, rot_dim/2]``;
    returns a new contiguous ``[T, H, D]``."""
    rot = x[..., :rot_dim]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if rot_dim < x.shape[-1]:
        out = torch.cat((out, x[..., rot_dim:]), dim=-1)
    return out
