"""Per-op benchmark: each Triton kernel against its PyTorch reference, on one batch shape.

On CUDA it times both with ``triton.testing.do_bench`` (median, L2 flushed between runs),
checks the two agree (max absolute difference), and prints time, speed-up, and achieved
GB/s (and TFLOP/s for attention) from each op's minimum memory traffic and arithmetic. On CPU
it times the references only: that is the CPU path ``pkgd``'s runner takes. ``--dry-run``
builds every input, runs each op once (Triton only on CUDA), prints the plan and no timings;
a test runs it with tiny sizes on CPU.

Defaults are a Llama-3-8B-sized layer (32 query / 8 KV heads of 128, hidden 4096, MLP 14336,
vocabulary 128256) serving 64 decodes at 1024 tokens of context and 4 prompts of 512 tokens::

    python -m pkgd_kernels.bench                     # all ops, bfloat16, on CUDA
    python -m pkgd_kernels.bench --ops decode,prefill --context-len 4096
    python -m pkgd_kernels.bench --device cpu --dtype float32 --num-heads 9 --num-kv-heads 3 \\
        --head-dim 64 --hidden 576 --intermediate 1536 --vocab 49152   # SmolLM2, CPU references
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

import torch

import pkgd_kernels as K

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Case:
    """One op ready to run: both implementations on the same inputs, and its cost model."""

    op: str
    shape: str
    triton: Callable[[], object]
    ref: Callable[[], object]
    bytes: int  # minimum bytes read + written per call
    flops: int = 0  # floating-point operations per call (attention only)


def _paged(a, device, dtype, seq_lens: list[int], q_lens: list[int]):
    """Query, a KV cache holding every sequence's keys in shuffled blocks, and metadata."""
    g = torch.Generator(device="cpu").manual_seed(0)
    bs = a.block_size
    per_seq = [-(-n // bs) for n in seq_lens]
    ids = torch.randperm(sum(per_seq), generator=g).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    start = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = ids[start : start + n]
        start += n
    shape = (sum(per_seq), bs, a.num_kv_heads, a.head_dim)
    key_cache = torch.randn(shape, generator=g).to(device, dtype)
    value_cache = torch.randn(shape, generator=g).to(device, dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), a.num_heads, a.head_dim, generator=g).to(device, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, tables.to(device), starts.to(device), lens


def _attention_cases(a, device, dtype, es: int) -> list[Case]:
    scale = a.head_dim**-0.5
    kv_row = a.num_kv_heads * a.head_dim * es  # bytes of one token's keys (or values)
    q_row = a.num_heads * a.head_dim * es
    heads = f"H={a.num_heads}/{a.num_kv_heads}x{a.head_dim}"
    seqs = [a.context_len] * a.num_seqs
    q, kc, vc, bt, _, lens = _paged(a, device, dtype, seqs, [1] * a.num_seqs)
    decode = Case(
        "paged_attention_decode",
        f"S={a.num_seqs} ctx={a.context_len} {heads}",
        lambda: K.paged_attention_decode_triton(q, kc, vc, bt, lens, scale),
        lambda: K.paged_attention_decode_ref(q, kc, vc, bt, lens, scale),
        bytes=2 * sum(seqs) * kv_row + 2 * a.num_seqs * q_row,
        flops=4 * sum(seqs) * a.num_heads * a.head_dim,
    )
    prompts = [a.prompt_len] * a.num_prompts
    pq, pkc, pvc, pbt, starts, plens = _paged(a, device, dtype, prompts, prompts)
    causal_pairs = sum(n * (n + 1) // 2 for n in prompts)
    args = (pq, pkc, pvc, pbt, starts, plens, scale)
    prefill = Case(
        "paged_attention_prefill",
        f"{a.num_prompts}x{a.prompt_len} {heads}",
        lambda: K.paged_attention_prefill_triton(*args),
        lambda: K.paged_attention_prefill_ref(*args),
        bytes=2 * sum(prompts) * (kv_row + q_row),
        flops=4 * causal_pairs * a.num_heads * a.head_dim,
    )
    return [decode, prefill]


def _elementwise_cases(a, device, dtype, es: int) -> list[Case]:
    g = torch.Generator(device="cpu").manual_seed(1)
    t, h, inter = a.num_tokens, a.hidden, a.intermediate

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(device, dt)

    x, res, w = rand(t, h), rand(t, h), rand(h)
    gate_up = rand(t, 2 * inter)
    kv = (rand(t, a.num_kv_heads, a.head_dim), rand(t, a.num_kv_heads, a.head_dim))
    num_blocks = -(-t // a.block_size) + 1
    caches = (
        rand(num_blocks, a.block_size, a.num_kv_heads, a.head_dim),
        rand(num_blocks, a.block_size, a.num_kv_heads, a.head_dim),
    )
    ref_caches = (caches[0].clone(), caches[1].clone())  # each path writes its own copy
    slots = torch.randperm(num_blocks * a.block_size, generator=g)[:t].to(device)
    pos = torch.randint(0, 4096, (t,), generator=g).to(device)
    qr, kr = rand(t, a.num_heads * a.head_dim), rand(t, a.num_kv_heads * a.head_dim)
    table = rand(4096, a.head_dim, dt=torch.float32)
    logits = rand(a.num_seqs, a.vocab, dt=torch.float32)
    top_k = torch.full((a.num_seqs,), 50, dtype=torch.int32, device=device)
    top_p = torch.full((a.num_seqs,), 0.9, dtype=torch.float32, device=device)
    qk_bytes = t * (a.num_heads + a.num_kv_heads) * a.head_dim * es

    def cache_triton() -> tuple[torch.Tensor, torch.Tensor]:
        K.reshape_and_cache_triton(*kv, *caches, slots)
        return caches

    def cache_ref() -> tuple[torch.Tensor, torch.Tensor]:
        K.reshape_and_cache_ref(*kv, *ref_caches, slots)
        return ref_caches

    return [
        Case(
            "reshape_and_cache",
            f"T={t} Hkv={a.num_kv_heads}x{a.head_dim}",
            cache_triton,
            cache_ref,
            bytes=4 * t * a.num_kv_heads * a.head_dim * es + 8 * t,
        ),
        Case(
            "rms_norm",
            f"T={t} H={h}",
            lambda: K.rms_norm_triton(x, w, 1e-5),
            lambda: K.rms_norm_ref(x, w, 1e-5),
            bytes=(2 * t * h + h) * es,
        ),
        Case(
            "fused_add_rms_norm",
            f"T={t} H={h}",
            lambda: K.fused_add_rms_norm_triton(x, res, w, 1e-5),
            lambda: K.fused_add_rms_norm_ref(x, res, w, 1e-5),
            bytes=(4 * t * h + h) * es,
        ),
        Case(
            "rotary_embedding",
            f"T={t} H={a.num_heads}/{a.num_kv_heads}x{a.head_dim}",
            lambda: K.rotary_embedding_triton(pos, qr, kr, a.head_dim, table, True),
            lambda: K.rotary_embedding_ref(pos, qr, kr, a.head_dim, table, True),
            bytes=2 * qk_bytes + t * (a.head_dim * 4 + 8),
        ),
        Case(
            "silu_and_mul",
            f"T={t} I={inter}",
            lambda: K.silu_and_mul_triton(gate_up),
            lambda: K.silu_and_mul_ref(gate_up),
            bytes=3 * t * inter * es,
        ),
        Case(
            "top_k_top_p_mask",
            f"S={a.num_seqs} V={a.vocab} k=50 p=0.9",
            lambda: K.top_k_top_p_mask_triton(logits, top_k, top_p),
            lambda: K.top_k_top_p_mask_ref(logits, top_k, top_p),
            bytes=2 * a.num_seqs * a.vocab * 4,
        ),
    ]


OPS = (
    "reshape_and_cache",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "top_k_top_p_mask",
)
_SHORT = {
    "decode": "paged_attention_decode",
    "prefill": "paged_attention_prefill",
    "cache": "reshape_and_cache",
    "rope": "rotary_embedding",
    "topk": "top_k_top_p_mask",
}


def build_cases(a: argparse.Namespace) -> list[Case]:
    """Every requested op's inputs on ``a.device`` in ``a.dtype``."""
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    es = torch.finfo(dtype).bits // 8
    cases = _attention_cases(a, device, dtype, es) + _elementwise_cases(a, device, dtype, es)
    return [c for c in cases if c.op in a.ops]


def _time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median milliseconds per call."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=max(iters, 1) * 2, return_mode="median"))
    fn()  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _max_diff(a: Any, b: Any) -> float:
    """Largest finite difference between two outputs: tensors, or tuples of tensors."""
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return max(float((x.float() - y.float()).nan_to_num(posinf=0.0, neginf=0.0).abs().max()) for x, y in pairs)


def _si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def run(a: argparse.Namespace, out: TextIO | None = None) -> None:
    """Build, check and time every requested op; print one line per op to ``out`` (stdout)."""
    out = out or sys.stdout
    device = torch.device(a.device)
    on_gpu = device.type == "cuda"
    # Under TRITON_INTERPRET=1 a dry run also runs the (interpreted) kernels on CPU tensors.
    run_triton = on_gpu or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    where = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"pkgd_kernels.bench: {a.dtype} on {where}" + (" (dry run)" if a.dry_run else ""), file=out)
    columns = ("bytes/call", "FLOP/call") if a.dry_run else ("GB/s", "TFLOP/s")
    print(
        f"{'op':24} {'shape':34} {'triton ms':>10} {'ref ms':>10} {'speedup':>8} "
        f"{columns[0]:>10} {columns[1]:>10} {'max|diff|':>10}",
        file=out,
    )
    for case in build_cases(a):
        ref_out = case.ref()
        diff = _max_diff(case.triton(), ref_out) if run_triton else float("nan")
        if a.dry_run:
            dashes = f"{'-':>10} {'-':>10} {'-':>8}"
            print(
                f"{case.op:24} {case.shape:34} {dashes} {_si(case.bytes):>10} {_si(case.flops):>10} {diff:10.2e}",
                file=out,
            )
            continue
        ref_ms = _time_ms(case.ref, device, a.iters)
        tri_ms = _time_ms(case.triton, device, a.iters) if on_gpu else float("nan")
        best = tri_ms if on_gpu else ref_ms
        print(
            f"{case.op:24} {case.shape:34} {tri_ms:10.4f} {ref_ms:10.4f} "
            f"{ref_ms / tri_ms:7.2f}x {case.bytes / best / 1e6:10.4g} "
            f"{case.flops / best / 1e9:10.4g} {diff:10.2e}",
            file=out,
        )
    if not on_gpu and not a.dry_run:
        print("CPU: the Triton column needs CUDA; GB/s and TFLOP/s are the reference's.", file=out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pkgd_kernels.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ops", default="all", help=f"comma-separated ops ({', '.join(OPS)}; short: {', '.join(_SHORT)})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--num-seqs", type=int, default=64, help="decode batch; top-k/top-p rows")
    p.add_argument("--context-len", type=int, default=1024, help="keys per decoding sequence")
    p.add_argument("--num-prompts", type=int, default=4, help="prefill batch")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--num-tokens", type=int, default=4096, help="rows for the elementwise ops")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's own choice); OpenMP threads "
        "busy-wait, so on a shared CPU 1 is often fastest",
    )
    p.add_argument("--dry-run", action="store_true", help="run each op once, time nothing")
    a = p.parse_args(argv)
    names = OPS if a.ops == "all" else [_SHORT.get(n, n) for n in a.ops.split(",")]
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        p.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(OPS)}")
    a.ops = tuple(names)
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu to time the references)")
    if a.num_heads % a.num_kv_heads:
        p.error("--num-heads must be a multiple of --num-kv-heads")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        run(args)
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
