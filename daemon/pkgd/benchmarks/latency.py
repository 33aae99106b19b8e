"""Latency of one batch (vLLM's ``benchmarks/latency``): the same batch of requests generated
again and again; each iteration's wall time is one sample.

The batch is ``batch_size`` prompts of ``input_len`` random token ids, each generating exactly
``output_len`` tokens (``ignore_eos``), ``n`` samples per prompt. The prefix cache is cleared
before every iteration, so each one computes its prompts again (otherwise every iteration
after the first would measure cached prefill).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from pkgd.benchmarks.throughput import Workload
from pkgd.sampling_params import SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)


@dataclasses.dataclass
class LatencyResult:
    """Seconds per iteration (``latencies``), their mean and percentiles (``{"50": s}``)."""

    latencies: list[float]
    avg_latency: float
    percentiles: dict[str, float]


def summarize(latencies: list[float]) -> LatencyResult:
    """Mean and percentiles (linear interpolation between closest ranks, numpy's default)."""
    ordered = sorted(latencies)

    def pct(p: float) -> float:
        if len(ordered) == 1:
            return ordered[0]
        rank = (len(ordered) - 1) * p / 100
        lo = int(rank)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)

    return LatencyResult(list(latencies), statistics.fmean(latencies), {str(p): pct(p) for p in PERCENTILES})


def run_latency(
    llm: Any,
    workload: Workload,
    *,
    n: int,
    temperature: float,
    num_iters: int,
    num_iters_warmup: int,
    detokenize: bool = True,
) -> LatencyResult:
    """Generate ``workload`` ``num_iters_warmup`` times untimed, then ``num_iters`` times timed."""
    params = [
        SamplingParams(
            n=n, temperature=temperature, top_p=1.0, max_tokens=out, ignore_eos=True, seed=i, detokenize=detokenize
        )
        for i, out in enumerate(workload.output_lens)
    ]

    def once() -> float:
        llm.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(workload.prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        got = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if got != n * sum(workload.output_lens):
            raise RuntimeError(f"the batch generated {got} tokens, expected {n * sum(workload.output_lens)}")
        return elapsed

    for _ in range(num_iters_warmup):
        once()
    return summarize([once() for _ in range(num_iters)])
