"""``pkgd bench throughput --dtypes float32,bfloat16,auto`` (or ``--quantizations auto,none``):
one offline engine per ``model.dtype`` (or ``model.quantization``) in one process, the same
workload through each in turn (the order reversed on every repeat, so a burst of load from
other tenants of a shared host falls on all of them), and the figures of each as ratios against
the first: output tokens/s of the batch, single-stream decode tokens/s, the bytes of the loaded
weights, and what ``auto`` chose (`pkgd.runner.loader.dtype.DtypeChoice`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pkgd.benchmarks.throughput import Workload, run_pkgd, run_single_stream


def compare_dtypes(
    llms: dict[str, Any],
    workload: Workload,
    *,
    repeats: int,
    ignore_eos: bool,
    temperature: float,
    single_stream_len: int | None,
    vocab_size: int,
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Run ``workload`` through each of ``llms`` (``model.dtype`` -> `LLM`) ``repeats`` times,
    alternating, and (unless ``single_stream_len`` is None) one request alone through each as
    often; the fastest run of each counts.

    Returns:
        One row per engine, in the given order: ``dtype`` (what ran), ``requested`` (the
        engine's name in ``llms``), ``quantization`` (`ModelInfo.quantization`),
        ``weight_bytes``, ``dtype_choice`` (the runner's `DtypeChoice` as a dict), ``output_tokens_per_s``,
        ``all_elapsed_s``, ``num_preemptions`` (all runs), ``num_kv_blocks``,
        ``kv_cache_dtype``, ``single_stream_decode_tokens_per_s`` (when measured).
    """
    names = list(llms)
    batch: dict[str, list[Any]] = {n: [] for n in names}
    single: dict[str, list[Any]] = {n: [] for n in names}
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            progress(f"{name}: batch run {rep + 1}/{repeats}")
            batch[name].append(run_pkgd(llms[name], workload, ignore_eos=ignore_eos, temperature=temperature))
    for rep in range(repeats if single_stream_len else 0):
        for name in names if rep % 2 == 0 else names[::-1]:
            progress(f"{name}: single stream {rep + 1}/{repeats}")
            assert single_stream_len is not None  # the loop runs only when it is set
            single[name].append(
                run_single_stream(
                    llms[name], input_len=single_stream_len, output_len=single_stream_len, vocab_size=vocab_size
                )
            )
    rows = []
    for name in names:
        engine = llms[name].engine
        runner = engine.model_runner
        best = min(batch[name], key=lambda r: r.elapsed)
        row: dict[str, Any] = {
            "requested": name,
            "dtype": runner.model_info.dtype,
            "quantization": getattr(runner.model_info, "quantization", "none"),
            "weight_bytes": getattr(runner.model_info, "weight_bytes", 0),
            "dtype_choice": runner.dtype_choice.as_dict() if hasattr(runner, "dtype_choice") else None,
            "output_tokens_per_s": best.output_tokens_per_s,
            "output_tokens": best.output_tokens,
            "all_elapsed_s": [r.elapsed for r in batch[name]],
            "num_preemptions": engine.stats().num_preemptions,
            "num_kv_blocks": engine.num_kv_blocks,
            "kv_cache_dtype": str(getattr(runner, "kv_dtype", "")).removeprefix("torch."),
        }
        if single[name]:
            row["single_stream_decode_tokens_per_s"] = max(s.decode_tokens_per_s for s in single[name])
        rows.append(row)
    return rows


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The comparison as lines of text: one per engine with its ratios against the first row,
    then what ``auto`` chose and the figures it measured."""
    base = rows[0]
    lines = [
        f"{'engine':12s} {'ran':9s} {'weights MB':>10s} {'ratio':>6s} {'KV blocks':>14s} {'output tok/s':>12s} "
        f"{'ratio':>6s} {'1-stream tok/s':>14s} {'ratio':>6s}  runs (s)"
    ]
    for r in rows:
        ss, bss = r.get("single_stream_decode_tokens_per_s"), base.get("single_stream_decode_tokens_per_s")
        wb, bwb = r.get("weight_bytes") or 0, base.get("weight_bytes") or 0
        ran = r["dtype"] if r.get("quantization", "none") == "none" else r["quantization"]
        lines.append(
            f"{r['requested']:12s} {ran:9s} {wb / 1e6:10.0f} "
            + (f"{wb / bwb:5.2f}x " if bwb else f"{'-':>6s} ")
            + f"{r['num_kv_blocks']:>6d} ({r['kv_cache_dtype']:>5s}) "
            f"{r['output_tokens_per_s']:12.1f} {r['output_tokens_per_s'] / base['output_tokens_per_s']:5.2f}x "
            + (f"{ss:14.1f} {ss / bss:5.2f}x" if ss and bss else f"{'-':>14s} {'-':>6s}")
            + "  "
            + ", ".join(f"{t:.1f}" for t in r["all_elapsed_s"])
        )
    for r in rows:
        choice = r.get("dtype_choice")
        if r["requested"] == "auto" and choice:
            figs = ", ".join(f"{k} {v}" for k, v in choice["figures"].items()) or "none"
            lines.append(
                f"auto chose {choice['dtype']} ({choice['reason']}; features {' '.join(choice['features']) or '-'}; "
                f"measured: {figs})"
            )
    return lines
