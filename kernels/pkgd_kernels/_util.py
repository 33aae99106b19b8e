"""Shared plumbing: backend choice, the lazy Triton import, and input checks.

Nothing here imports Triton at module level: ``import pkgd_kernels`` must stay cheap and work on
machines without a GPU (API processes, ``pkgd --help``). The Triton modules
(``pkgd_kernels.*_triton``) are imported on the first call that needs them, so
``TRITON_INTERPRET`` is read then, when ``triton.jit`` decorates their kernels.

Every check raises ``ValueError`` naming the op, the argument, what was expected and what was
given, and runs before anything is written, so bad input changes nothing. Checks look at
shapes, dtypes and devices only: checking values (a slot past the cache, a sequence length past
its block table) would need a device-to-host copy on CUDA, so value checks live in the
reference implementations, where they are free.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import ContextManager, Sequence

import torch


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a dispatcher should run the Triton kernel for ``tensor``: True on CUDA (and ROCm,
    which PyTorch also reports as ``cuda``), False elsewhere, where the reference runs."""
    return tensor.is_cuda


def triton_module(name: str) -> ModuleType:
    """Import ``pkgd_kernels.<name>`` (a module of ``@triton.jit`` kernels) on first use.

    Raises:
        ImportError: Triton is not installed; the message says how to get the reference path.
    """
    try:
        return importlib.import_module(f"pkgd_kernels.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        raise ImportError(
            f"pkgd_kernels.{name} needs Triton (pip install triton); "
            "call the *_ref function or pass CPU tensors to use the PyTorch reference"
        ) from exc


def on_device(tensor: torch.Tensor) -> ContextManager:
    """Make ``tensor``'s CUDA device current while a kernel launches: Triton launches on the
    current device, which need not be the one holding the data."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with unit stride along its last dim, copied only when it has another: the
    kernels index 1-D metadata and the columns of tables as contiguous."""
    if tensor.dim() == 0 or tensor.shape[-1] <= 1 or tensor.stride(-1) == 1:
        return tensor
    return tensor.contiguous()


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1): Triton block shapes must be powers of 2."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_shape(op: str, name: str, tensor: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Check ``tensor`` has ``len(shape)`` dims and each size given (None = any).

    Raises:
        ValueError: rank or a size differs.
    """
    # Dispatchers run this on every call: no work beyond the comparison unless it fails.
    sizes = tensor.shape
    if len(sizes) == len(shape):
        for s, got in zip(shape, sizes):
            if s is not None and s != got:
                break
        else:
            return
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    raise ValueError(f"{op}: {name} must have shape {want}, got {list(sizes)}")


def check_dtype(op: str, name: str, tensor: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
    """Check ``tensor.dtype`` is one of ``dtypes``.

    Raises:
        ValueError: another dtype.
    """
    if tensor.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        got = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"{op}: {name} must be {names}, got {got}")


def check_same(op: str, tensors: dict[str, torch.Tensor], *, dtype: bool = True) -> None:
    """Check every tensor in ``tensors`` lives on one device (and, with ``dtype``, shares a dtype).

    Raises:
        ValueError: naming the first tensor that differs from the first one given.
    """
    (first_name, first), *rest = tensors.items()
    for name, tensor in rest:
        if tensor.device != first.device:
            raise ValueError(f"{op}: {name} is on {tensor.device} but {first_name} is on {first.device}")
        if dtype and tensor.dtype != first.dtype:
            raise ValueError(f"{op}: {name} is {tensor.dtype} but {first_name} is {first.dtype}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Activation / KV-cache dtypes every op accepts."""


def check_kv_cache(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check a layer's paged KV cache pair and return its sizes.

    Both are ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype and device.

    Returns:
        ``(num_blocks, block_size, num_kv_heads, head_dim)``.

    Raises:
        ValueError: a rank, size, dtype or device differs.
    """
    check_shape(op, "key_cache", key_cache, [None] * 4)
    check_shape(op, "value_cache", value_cache, list(key_cache.shape))
    check_dtype(op, "key_cache", key_cache, FLOAT_DTYPES)
    check_same(op, {"key_cache": key_cache, "value_cache": value_cache})
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim
