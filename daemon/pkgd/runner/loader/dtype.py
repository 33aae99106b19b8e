"""Resolving ``model.dtype`` to a torch dtype: the one place that decides (DESIGN.md §5).

``auto`` means:

* CUDA: the checkpoint's dtype (``torch_dtype`` in ``config.json``), float32 when unknown.
* CPU: bfloat16 only when the checkpoint is 16-bit *and* the CPU has native bf16 arithmetic
  (x86 ``avx512_bf16`` or ``amx_bf16``, Arm ``bf16``); float32 otherwise. Without those
  instructions bf16 GEMMs go through conversion paths: measured on an AVX2 machine, bf16
  ``torch.mm`` ran ~200x slower than fp32 (0.3-1.3 vs 125 GFLOP/s). float16 checkpoints run
  as bf16 on such CPUs (x86 has no fast fp16 GEMM without AMX-FP16), as vLLM's CPU backend does.
  A float32 checkpoint (every converted GGUF) stays float32.
"""

from __future__ import annotations

import functools

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (x86 ``flags`` / Arm ``Features``); empty
    where unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | set[str] | None = None) -> bool:
    """Whether the CPU computes bf16 natively (``flags`` defaults to this machine's)."""
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else set(flags)))


def resolve_dtype(
    requested: str,
    checkpoint_dtype: str | None,
    device_type: str,
    *,
    flags: frozenset[str] | set[str] | None = None,
) -> torch.dtype:
    """The torch dtype to run in.

    Args:
        requested: ``model.dtype``: ``auto``, ``float32``, ``bfloat16`` or ``float16``.
        checkpoint_dtype: ``torch_dtype`` of ``config.json`` (None when absent).
        device_type: ``"cpu"`` or ``"cuda"``.
        flags: CPU feature flags (tests); default: this machine's.

    Raises:
        ValueError: an unknown ``requested`` value.
    """
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"model.dtype {requested!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[requested]
    ckpt = _CHECKPOINT_DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.float32)
    if device_type == "cuda":
        return ckpt
    if ckpt in (torch.bfloat16, torch.float16) and cpu_has_native_bf16(flags):
        return torch.bfloat16
    return torch.float32
