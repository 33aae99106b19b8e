"""Model-step speed of `ModelRunner` against this machine's own limits, measured in one run.

Prints, for the configured thread count:

* the fp32 GEMM FLOP/s ``torch.mm`` reaches (best of a few shapes) and the memory read
  bandwidth (``Tensor.sum`` over a buffer far larger than the caches);
* prefill and batched-decode FLOP/s of the runner, ``2 x parameters x tokens / time`` with the
  LM head counted only for the rows that use it (attention FLOPs not counted), as a
  fraction of the GEMM figure (target >= 50% for large batches);
* single-stream decode tokens/s (128-token prompt, 128 outputs) against the bandwidth bound
  ``read bandwidth / weight bytes per token`` (target >= 70%).

Each figure is measured ``--repeat`` times, each time between two measurements of its
reference (the larger one counts); the round with the median ratio is printed with the spread,
so a burst of load from other processes shows as spread rather than as a flattering ratio. Run:

    .venv/bin/python benchmarks/model_step.py --threads 1
    .venv/bin/python benchmarks/model_step.py --threads 2 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

# as in an engine process (parallel.cpu_huge_pages, pkgd.host.set_torch_huge_pages)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

from pkgd.config.vllm_config import VllmConfig  # noqa: E402
from pkgd.model_files.resolve import resolve_model  # noqa: E402
from pkgd.runner.model_runner import ModelRunner  # noqa: E402
from pkgd.sampling_params import SamplingParams  # noqa: E402
from pkgd.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402

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


def gemm_flops(repeat: int, dtype: torch.dtype = torch.float32) -> float:
    """Best ``torch.mm`` FLOP/s in ``dtype`` over shapes like the model's large-batch GEMMs."""
    best = 0.0
    for m, k, n in ((1024, 1024, 1024), (512, 576, 3072), (2048, 1536, 576), (256, 576, 1728)):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
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

    print(
        f"model {runner.model_files.name} ({runner.arch.architecture}), dtype {runner.model_info.dtype}, "
        f"threads {torch.get_num_threads()}, body {body / 1e6:.1f}M + LM head {lm / 1e6:.1f}M parameters, "
        f"{weight_bytes / 1e6:.0f} MB of weights read per decoded token"
    )
    # Each figure is paired with machine measurements taken right before and right after it
    # (the larger one is its reference, so a quiet moment never flatters a ratio), which keeps
    # ratios meaningful when other processes load the machine in bursts.
    results: dict[str, list[tuple[float, float]]] = {}

    def record(name: str, value: float, reference: float) -> None:
        results.setdefault(name, []).append((value, reference))

    def gemm() -> float:
        return gemm_flops(1, runner.dtype)

    for rep in range(args.repeat):
        for n, length in () if args.skip_prefill else ((1, 512), (4, 512)):
            before = gemm()
            t, _ = best_time(lambda: h.start(prompts(n, length)), 1)  # noqa: B023 - called at once
            record(f"prefill {n}x{length}", 2 * (body * n * length + lm * n) / t, max(before, gemm()))
        for b in args.batch:
            h.start(prompts(b, 128))
            before = gemm()
            t, _ = best_time(h.decode, 1, inner=4)
            record(f"decode batch {b}", 2 * (body + lm) * b / t, max(before, gemm()))
        h.start(prompts(1, 128))
        before = read_bandwidth(1)
        t0 = time.perf_counter()
        for _ in range(127):
            h.decode()
        tps = 127 / (time.perf_counter() - t0)
        record("single-stream", tps, max(before, read_bandwidth(1)) / weight_bytes)
        print(f"  round {rep + 1}/{args.repeat} done", flush=True)
    report(results, str(runner.dtype).removeprefix("torch."))


def report(results: dict[str, list[tuple[float, float]]], dtype: str) -> None:
    """Print each figure: the round with the median ratio, and the spread of ratios."""
    print()
    for name, pairs in results.items():
        pairs = sorted(pairs, key=lambda p: p[0] / p[1])
        v, r = pairs[len(pairs) // 2]
        lo, hi = pairs[0][0] / pairs[0][1], pairs[-1][0] / pairs[-1][1]
        if name == "single-stream":
            print(
                f"{name + ' decode:':24s} {v:6.1f} tok/s vs bound {r:5.1f} tok/s (read bandwidth "
                f"/ weight bytes) = {v / r:5.1%}   (rounds {lo:.0%}-{hi:.0%})"
            )
        else:
            print(
                f"{name + ':':24s} {v / 1e9:6.1f} GFLOP/s vs {dtype} torch.mm {r / 1e9:5.1f} GFLOP/s = "
                f"{v / r:5.1%}   (rounds {lo:.0%}-{hi:.0%})"
            )


if __name__ == "__main__":
    main()
