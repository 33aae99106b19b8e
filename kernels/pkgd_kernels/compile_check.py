"""Compile every Triton kernel for NVIDIA GPUs on a machine without one.

Triton's interpreter (``TRITON_INTERPRET=1``, used by the tests) checks what the kernels
compute, but it runs them as Python and NumPy, so it accepts code the compiler rejects
(``break``, a ``return`` inside a loop, calls into Python libraries, types NumPy coerces) and
says nothing of shared memory. This check closes that gap without a GPU: it calls
each public ``*_triton`` function on small CPU tensors of realistic shapes and dtypes with the
``@triton.jit`` kernels swapped for recorders, then compiles every distinct recorded launch
with ``triton.compile`` for each target (Triton IR -> TTGIR -> LLVM IR -> PTX -> cubin through
the ``ptxas`` bundled with Triton), as the JIT would on first launch (integer arguments equal
to 1 specialised as constants, like the JIT does). It fails when a kernel does not compile or
needs more shared memory than the target has.

Usage: ``python -m pkgd_kernels.compile_check [--arch 90] [--dtype bfloat16] [--head-dim 128]``
(each repeatable; default: sm_90 and sm_80, all dtypes, head sizes 64 and 128); exits 1 on
failure.
Must run in a process where ``TRITON_INTERPRET`` is unset (the tests start a subprocess).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

import pkgd_kernels as K

MODULES = (
    "cache_triton",
    "norm_triton",
    "activation_triton",
    "rotary_triton",
    "attention_decode_triton",
    "attention_prefill_triton",
    "sampling_triton",
    "lora_triton",
)
# Most shared memory one block may use, by compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability": 163 KB on sm_80, 99 KB on sm_86/89,
# 227 KB on sm_90).
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_POINTER_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
}


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self, kernel: Any, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


@contextmanager
def _recording() -> Iterator[list]:
    """Swap every kernel in the Triton modules for a recorder; yield the launch list."""
    from triton.runtime.jit import JITFunction

    launches: list = []
    saved = []
    for name in MODULES:
        module = importlib.import_module(f"pkgd_kernels.{name}")
        for attr, value in vars(module).items():
            if isinstance(value, JITFunction) and attr.endswith("_kernel"):
                saved.append((module, attr, value))
                setattr(module, attr, _Recorder(value, launches))
    try:
        yield launches
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def _run_ops(dtype: torch.dtype, head_dim: int) -> None:
    """Call every public Triton op once on CPU tensors shaped like a small model's batch."""
    g = torch.Generator().manual_seed(0)
    num_tokens, num_heads, num_kv_heads, block_size, hidden = 24, 8, 2, 16, 512

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(dtype)

    cache = rand(64, block_size, num_kv_heads, head_dim)
    K.reshape_and_cache_triton(
        rand(num_tokens, num_kv_heads, head_dim),
        rand(num_tokens, num_kv_heads, head_dim),
        cache,
        cache.clone(),
        torch.arange(num_tokens),
    )
    x = rand(num_tokens, hidden)
    K.rms_norm_triton(x, rand(hidden), 1e-6)
    K.fused_add_rms_norm_triton(x, rand(num_tokens, hidden), rand(hidden), 1e-6)
    K.rms_norm_triton(rand(2, 8192), rand(8192), 1e-6)  # two-pass rows
    K.silu_and_mul_triton(rand(num_tokens, 2 * hidden))
    K.gelu_tanh_and_mul_triton(rand(num_tokens, 2 * hidden))
    table = torch.randn(4096, head_dim, dtype=torch.float32)
    for is_neox in (True, False):
        K.rotary_embedding_triton(
            torch.arange(num_tokens),
            rand(num_tokens, num_heads * head_dim),
            rand(num_tokens, num_kv_heads * head_dim),
            head_dim,
            table,
            is_neox,
        )
    options = ((0, 0.0), (16, 50.0))  # plain; sliding window and soft-cap (Gemma 2)
    for window, cap in options:
        for width in (4, 64):  # one partition; split-KV with the reduction
            tables = torch.zeros(4, width, dtype=torch.int32)
            lens = torch.full((4,), 10, dtype=torch.int32)
            q = rand(4, num_heads, head_dim)
            K.paged_attention_decode_triton(q, cache, cache, tables, lens, 0.125, window, cap)
    tables = torch.zeros(3, 8, dtype=torch.int32)
    starts = torch.tensor([0, 10, 20, num_tokens], dtype=torch.int32)
    lens = torch.full((3,), 30, dtype=torch.int32)
    for window, cap in options:
        q = rand(num_tokens, num_heads, head_dim)
        K.paged_attention_prefill_triton(q, cache, cache, tables, starts, lens, 0.125, window, cap)
    K.top_k_top_p_mask_triton(torch.randn(4, 50000), torch.full((4,), 50, dtype=torch.int32), torch.full((4,), 0.9))
    slots = torch.tensor([-1, 0, 1, 1] * (num_tokens // 4))
    for rank in (8, 3 * 16):  # o/down at rank 8; Q/K/V parts stacked at rank 16
        K.add_lora_triton(rand(num_tokens, 3 * hidden), x, rand(2, rank, hidden), rand(2, 3 * hidden, rank), slots)


def _signature(kernel: Any, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """Triton signature, constants and launch options of one recorded launch."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip(kernel.arg_names, args)) | kwargs
    signature: dict[str, str] = {}
    constants: dict[str, Any] = {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr or value is None or (type(value) is int and value == 1):
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: cannot type argument {param.name}={value!r}")
    return signature, constants, options


DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def collect_launches(dtypes: list[str], head_dims: list[int]) -> list[tuple[Any, dict, dict, dict]]:
    """Distinct ``(kernel, signature, constants, options)`` the public ops launch."""
    distinct: dict[str, tuple] = {}
    with _recording() as launches:
        for dtype in dtypes:
            for head_dim in head_dims:
                _run_ops(DTYPES[dtype], head_dim)
    for kernel, args, kwargs in launches:
        sig, consts, opts = _signature(kernel, args, dict(kwargs))
        distinct.setdefault(f"{kernel.__name__}{sig}{consts}{opts}", (kernel, sig, consts, opts))
    return list(distinct.values())


def check(
    archs: list[int],
    dtypes: list[str],
    head_dims: list[int],
    log: Callable[[str], None] = print,
) -> list[str]:
    """Compile every distinct launch for each ``sm_<arch>``; return the failures."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = []
    launches = collect_launches(dtypes, head_dims)
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for kernel, sig, consts, opts in launches:
            label = f"sm_{arch} {kernel.__name__} {_describe(sig, consts)}"
            start = time.perf_counter()
            try:
                compiled = triton.compile(ASTSource(kernel, sig, consts), target=target, options=opts)
            except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
                failures.append(f"{label}: {type(exc).__name__}: {exc}".splitlines()[0])
                log(f"FAIL {failures[-1]}")
                continue
            shared = compiled.metadata.shared
            limit = SHARED_MEMORY_LIMIT.get(arch, 99 * 1024)
            status = "ok" if shared <= limit else "FAIL"
            if shared > limit:
                failures.append(f"{label}: {shared} B shared memory > {limit} B")
            log(
                f"{status:4} {label}: {shared} B shared, {compiled.metadata.num_warps} warps, "
                f"{time.perf_counter() - start:.1f} s"
            )
    return failures


def _describe(sig: dict, consts: dict) -> str:
    dtypes = sorted({t for t in sig.values() if t.startswith("*f") or t.startswith("*b")})
    shown = {k: v for k, v in consts.items() if k.isupper()}
    return f"{','.join(dtypes)} {shown}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pkgd_kernels.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch",
        type=int,
        action="append",
        help="CUDA compute capability x10 to compile for (repeatable; default 90 and 80)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), action="append", help="model dtype (repeatable; default all three)"
    )
    parser.add_argument(
        "--head-dim", type=int, action="append", help="attention head size (repeatable; default 64 and 128)"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the interpreter cannot compile kernels")
    failures = check(args.arch or [90, 80], args.dtype or sorted(DTYPES), args.head_dim or [64, 128])
    print(f"{len(failures)} failure(s)")
    for failure in failures:
        print(f"  {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
