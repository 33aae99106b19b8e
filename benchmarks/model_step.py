"""Model-step speed of `ModelRunner` against this machine's own limits, measured in one run.

Prints, for the configured thread count:

* the fp32 GEMM FLOP/s ``torch.mm`` reaches (best of a few shapes) and the memory read
  bandwidth (``Tensor.sum`` over a buffer far larger than the caches);
* prefill and batched-decode FLOP/s of the runner, ``2 x parameters x tokens / time`` with the
  LM head counted only for the rows that use it (attention FLOPs not counted), as a
  fraction of the GEMM figure (target >= 50% for large batches);
* single-stream decode tokens/s (128-token prompt, 128 outputs) against the bandwidth bound
  ``read bandwidth / weight bytes per token`` (target >= 70%).

Every figure is the best of ``--repeat`` interleaved measurements, so a burst of load from
other processes on a shared machine shows as spread rather than as a wrong ratio. Run:

    .venv/bin/python benchmarks/model_step.py --threads 1
    .venv/bin/python benchmarks/model_step.py --threads 2 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pkgd.config.vllm_config import VllmConfig
from pkgd.engine.sampling_params import SamplingParams
from pkgd.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pkgd.runner.loader.resolve import resolve_model
from pkgd.runner.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


class Harness:
    """Drives the runner with hand-built SchedulerOutputs (a tiny scheduler for fixed shapes)."""

    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int = 16) -> None:
        self.runner = runner
        self.block_size = block_size
        runner.initialize_kv_cache(num_blocks, block_size)
        self.num_blocks = num_blocks
        self.next_id = 0

    def start(self, prompts: list[list[int]]) -> list[str]:
        """Prefill ``prompts`` in one step (fresh blocks, no prefix reuse); returns their ids."""
        self.reset()
        new, sched = [], {}
        self.reqs = {}
        for p in prompts:
            rid = f"r{self.next_id}"
            self.next_id += 1
            blocks = self._alloc(-(-len(p) // self.block_size))
            new.append(NewRequestData(rid, p, [], GREEDY, blocks, 0))
            sched[rid] = len(p)
            self.reqs[rid] = [len(p), blocks]
        self._run(SchedulerOutput(new, CachedRequestData(), sched, sum(sched.values()), set()))
        return list(self.reqs)

    def decode(self) -> None:
        """One decode step for every started request."""
        cached = CachedRequestData()
        for rid, (n, blocks) in self.reqs.items():
            fresh = self._alloc(1) if n % self.block_size == 0 else []
            blocks += fresh
            cached.req_ids.append(rid)
            cached.new_block_ids.append(fresh)
            cached.num_computed_tokens.append(n)
            self.reqs[rid][0] = n + 1
        sched = {rid: 1 for rid in self.reqs}
        self._run(SchedulerOutput([], cached, sched, len(sched), set()))

    def reset(self) -> None:
        ids = set(getattr(self, "reqs", {}))
        self.free = list(range(self.num_blocks))
        if ids:
            self._run(SchedulerOutput([], CachedRequestData(), {}, 0, ids))
        self.reqs = {}

    def _alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("benchmark KV cache too small")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def _run(self, so: SchedulerOutput) -> None:
        self.runner.execute_model(so)


def best_time(fn: Callable[[], None], repeat: int, inner: int = 1) -> tuple[float, float]:
    """(best, median) seconds per call over ``repeat`` rounds of ``inner`` calls."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return min(times), statistics.median(times)


def gemm_flops(repeat: int) -> float:
    """Best fp32 ``torch.mm`` FLOP/s over shapes like the model's large-batch GEMMs."""
    best = 0.0
    for m, k, n in ((1024, 1024, 1024), (512, 576, 3072), (2048, 1536, 576), (256, 576, 1728)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        t, _ = best_time(lambda: torch.mm(a, b), repeat, inner=5)
        best = max(best, 2 * m * k * n / t)
    return best


def read_bandwidth(repeat: int) -> float:
    """Bytes/s of a streaming read (``sum`` over 256 MB, far beyond the caches)."""
    buf = torch.ones(64 << 20)
    t, _ = best_time(lambda: buf.sum(), repeat, inner=3)
    return buf.numel() * 4 / t


def param_counts(runner: ModelRunner) -> tuple[int, int]:
    """(body parameters applied to every token, LM-head parameters)."""
    lm = runner.model.lm_head.weight.numel()
    total = sum(p.numel() for p in runner.model.parameters())
    embed = 0 if runner.arch.tie_word_embeddings else runner.model.embed_tokens.weight.numel()
    return total - lm - embed, lm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine's own setting)")
    ap.add_argument("--source", default=None, help="model.source (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="*", default=[16, 64], help="decode batch sizes")
    ap.add_argument("--skip-prefill", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_kw = {"dtype": args.dtype} | ({"source": args.source} if args.source else {})
    cfg = VllmConfig(model=model_kw)
    runner = ModelRunner(cfg, resolve_model(cfg.model), device=torch.device("cpu"))
    body, lm = param_counts(runner)
    elt = torch.empty(0, dtype=runner.dtype).element_size()
    weight_bytes = (body + lm) * elt
    max_batch = max(args.batch + [4])
    h = Harness(runner, num_blocks=max_batch * (256 // 16 + 2) + 64)
    vocab = runner.model_info.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(100, vocab, (n, length), generator=g).tolist()

    print(f"model {runner.model_files.name} ({runner.arch.architecture}), dtype {runner.model_info.dtype}, "
          f"threads {torch.get_num_threads()}, body {body / 1e6:.1f}M + LM head {lm / 1e6:.1f}M parameters")
    rows = []
    for rep in range(args.repeat):
        gemm, bw = gemm_flops(1), read_bandwidth(1)
        rows.append(("gemm", gemm))
        rows.append(("bw", bw))
        for n, length in () if args.skip_prefill else ((1, 512), (4, 512)):
            t, _ = best_time(lambda: h.start(prompts(n, length)), 1)
            rows.append((f"prefill {n}x{length}", 2 * (body * n * length + lm * n) / t))
        for b in args.batch:
            h.start(prompts(b, 128))
            t, _ = best_time(h.decode, 1, inner=4)
            rows.append((f"decode batch {b}", 2 * (body + lm) * b / t))
        h.start(prompts(1, 128))
        t0 = time.perf_counter()
        for _ in range(127):
            h.decode()
        rows.append(("single-stream tok/s", 127 / (time.perf_counter() - t0)))
        print(f"  round {rep + 1}/{args.repeat} done", flush=True)
    best = {}
    for k, v in rows:
        best[k] = max(best.get(k, 0.0), v)
    spread = {k: (min(v for kk, v in rows if kk == k), max(v for kk, v in rows if kk == k)) for k in best}
    gemm, bw = best["gemm"], best["bw"]
    bound = bw / weight_bytes
    print(f"\nfp32 torch.mm GEMM:        {gemm / 1e9:7.1f} GFLOP/s   (range {spread['gemm'][0] / 1e9:.1f}-{spread['gemm'][1] / 1e9:.1f})")
    print(f"read bandwidth (sum):      {bw / 1e9:7.1f} GB/s      (range {spread['bw'][0] / 1e9:.1f}-{spread['bw'][1] / 1e9:.1f})")
    for k in best:
        if k.startswith(("prefill", "decode")):
            lo, hi = spread[k]
            print(f"{k + ':':26s} {best[k] / 1e9:7.1f} GFLOP/s = {best[k] / gemm:5.1%} of GEMM   (range {lo / 1e9:.1f}-{hi / 1e9:.1f})")
    tps = best["single-stream tok/s"]
    print(f"single-stream decode:      {tps:7.1f} tok/s  = {tps / bound:5.1%} of the bandwidth bound "
          f"{bound:.1f} tok/s ({weight_bytes / 1e6:.0f} MB of weights per token)")


if __name__ == "__main__":
    main()
