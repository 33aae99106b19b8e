"""SiLU-and-mul, the gate of a SwiGLU MLP (Shazeer 2020, "GLU Variants Improve Transformer";
SiLU from Elfwing et al. 2018 / Hendrycks & Gimpel 2016): ``silu(x[:, :I]) * x[:, I:]``.

`gelu_tanh_and_mul` is the same with GELU's tanh approximation in place of SiLU (GeGLU, Gemma).

The input is the fused ``gate_up_proj`` output ``[T, 2*I]`` (gate first, as vLLM and Llama's
merged weights lay it out); more leading dims are accepted and kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pkgd_kernels._util import FLOAT_DTYPES, check_dtype, on_device, triton_module, use_triton

_OP = "silu_and_mul"
_BLOCK = 1024  # columns per program


def _check(x: torch.Tensor, op: str = _OP) -> int:
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"{op}: x must have shape [T, 2*I] (even last dim), got {list(x.shape)}")
    check_dtype(op, "x", x, FLOAT_DTYPES)
    return x.shape[-1] // 2


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = x.chunk(2, -1)`` (PyTorch reference).

    Args:
        x: ``[T, 2*I]`` float32/float16/bfloat16 (any leading dims).

    Returns:
        A new ``[T, I]`` tensor, ``x.dtype``.

    Raises:
        ValueError: odd last dim or unsupported dtype.
    """
    inter = _check(x)
    return F.silu(x[..., :inter]) * x[..., inter:]


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_and_mul_ref` (same argument, result and errors); computes in
    float32 and rounds once, so bf16/fp16 results may differ from the reference by one ulp."""
    inter = _check(x)
    rows = x.reshape(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        with on_device(x):
            triton_module("activation_triton").launch_silu_and_mul(rows, out, block=_BLOCK)
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """CPU form of :func:`silu_and_mul_ref` (same argument and result; unchecked): the
    product written into the SiLU output, one temporary fewer."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]).mul_(x[..., half:])


def silu_and_mul(x: torch.Tensor, *, kernels=None) -> torch.Tensor:
    """SiLU-and-mul: :func:`silu_and_mul_triton` on CUDA tensors; on CPU the C form when
    ``kernels`` (a `pkgd_kernels.cpu.CpuKernels`) takes ``x``, else :func:`silu_and_mul_cpu`
    (argument and errors as :func:`silu_and_mul_ref`)."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    _check(x)
    if kernels is not None and kernels.takes_silu_and_mul(x):
        return kernels.silu_and_mul(x)
    return silu_and_mul_cpu(x)


_GELU_OP = "gelu_tanh_and_mul"


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's gate (Shazeer 2020) with GELU's tanh approximation (Hendrycks & Gimpel 2016;
    transformers' ``gelu_pytorch_tanh``, Gemma's activation): ``gelu_tanh(gate) * up`` with
    ``gate, up = x.chunk(2, -1)`` (PyTorch reference; argument, result and errors as
    :func:`silu_and_mul_ref`)."""
    inter = _check(x, _GELU_OP)
    return F.gelu(x[..., :inter], approximate="tanh") * x[..., inter:]


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`gelu_tanh_and_mul_ref` (computes in float32, rounds once)."""
    inter = _check(x, _GELU_OP)
    rows = x.reshape(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        with on_device(x):
            triton_module("activation_triton").launch_gelu_tanh_and_mul(rows, out, block=_BLOCK)
    return out.view(*x.shape[:-1], inter)


def gelu_tanh_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """CPU form of :func:`gelu_tanh_and_mul_ref` (unchecked): the product written into the
    GELU output."""
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh").mul_(x[..., half:])


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GELU(tanh)-and-mul: :func:`gelu_tanh_and_mul_triton` on CUDA tensors, else
    :func:`gelu_tanh_and_mul_cpu` (no C form; argument and errors as the reference)."""
    if use_triton(x):
        return gelu_tanh_and_mul_triton(x)
    _check(x, _GELU_OP)
    return gelu_tanh_and_mul_cpu(x)
