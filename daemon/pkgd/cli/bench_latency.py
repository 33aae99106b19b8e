"""``pkgd bench latency``: latency of one batch (vLLM's ``vllm bench latency``).

Generates the same batch (``--batch-size`` prompts of ``--input-len`` random tokens, exactly
``--output-len`` new tokens each, ``--n`` samples per prompt) ``--num-iters-warmup`` times
untimed, then ``--num-iters`` times, and prints the mean and the 10/25/50/75/90/99th
percentile latency of an iteration. ``--baseline hf`` times the same batch through Hugging Face
``generate()`` (one static batch, greedy) in the same run and prints the ratio.
``--output-json`` writes vLLM's fields (``avg_latency``, ``latencies``, ``percentiles``).
The configuration (model, ``--max-num-seqs``, ``cache.*`` …) is composed from every layer.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

DESCRIPTION = """\
Latency of one batch, as vllm bench latency measures it: --batch-size prompts of --input-len
random tokens, exactly --output-len new tokens each (--n samples per prompt), generated
--num-iters-warmup times untimed, then --num-iters times. Prints the mean and the
10/25/50/75/90/99th percentile latency of an iteration; --baseline hf times the same batch
through Hugging Face generate() in the same run and prints the ratio. The configuration
(model, --max-num-seqs, cache.* ...) is composed from every layer."""

EXAMPLES = """\
examples:
  pkgd bench latency --batch-size 8 --input-len 32 --output-len 128
  pkgd bench latency --baseline hf --output-json latency.json"""


def add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    p.add_argument("--n", type=int, default=1, help="samples per request")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (vLLM's benchmark samples at 1.0)"
    )
    p.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first")
    p.add_argument("--num-iters", type=int, default=30, help="timed iterations")
    p.add_argument("--disable-detokenize", action="store_true", help="skip detokenizing the outputs")
    p.add_argument(
        "--baseline", choices=["none", "hf"], default="none", help="hf: also time transformers generate() on the batch"
    )
    p.add_argument("--output-json", default=None, help="also write the figures to this JSON file")


def run_latency(args: argparse.Namespace, offline_llm: Callable[[argparse.Namespace], Any]) -> int:
    """Run the benchmark on the `LLM` ``offline_llm(args)`` builds (`pkgd.cli.bench.offline_llm`)."""
    import torch

    from pkgd.benchmarks import latency, throughput

    for name in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, name) < 1:
            raise SystemExit(f"pkgd bench latency: --{name.replace('_', '-')} must be at least 1")
    llm = offline_llm(args)
    torch.set_num_threads(llm.config.parallel.cpu_threads)
    engine = llm.engine
    workload = throughput.make_workload(
        num_prompts=args.batch_size,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_size=engine.vocab_size,
        tokenizer=llm.get_tokenizer(),
        seed=llm.config.model.seed,
    )
    res = latency.run_latency(
        llm,
        workload,
        n=args.n,
        temperature=args.temperature,
        num_iters=args.num_iters,
        num_iters_warmup=args.num_iters_warmup,
        detokenize=not args.disable_detokenize,
    )
    fig: dict[str, Any] = {
        "avg_latency": res.avg_latency,
        "latencies": res.latencies,
        "percentiles": res.percentiles,
        "model": engine.model_name,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "n": args.n,
        "threads": torch.get_num_threads(),
    }
    print(
        f"pkgd bench latency: {engine.model_name}, batch {args.batch_size} x n {args.n}, input {args.input_len}, "
        f"output {args.output_len}, {args.num_iters} iterations after {args.num_iters_warmup} warm-up, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"Avg latency: {res.avg_latency:.4f} seconds")
    for p, value in res.percentiles.items():
        print(f"{p}% percentile latency: {value:.4f} seconds")
    if args.baseline == "hf":
        fig.update(_hf_baseline(llm, workload, args))
        print(
            f"HF generate() (greedy, one static batch of {args.batch_size}): avg {fig['hf_avg_latency']:.4f} s, "
            f"P50 {fig['hf_percentiles']['50']:.4f} s; pkgd / HF avg latency: "
            f"{res.avg_latency / fig['hf_avg_latency']:.2f}x"
        )
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(fig, f, indent=2)
    llm.shutdown()
    return 0


def _hf_baseline(llm: Any, workload: Any, args: argparse.Namespace) -> dict[str, Any]:
    from pkgd.benchmarks.hf_baseline import load_hf_model, run_hf
    from pkgd.benchmarks.latency import summarize

    if args.n != 1:
        raise SystemExit("pkgd bench latency: --baseline hf times n=1 only")
    engine = llm.engine
    model_dir = getattr(engine.model_files, "model_dir", None)
    if model_dir is None:
        raise SystemExit("--baseline hf needs a model directory with safetensors")
    model = load_hf_model(model_dir)
    tok = llm.get_tokenizer()
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (engine.eos_token_id or 0)

    def once() -> float:
        return run_hf(
            model,
            workload,
            batch_size=args.batch_size,
            ignore_eos=True,
            pad_token_id=pad,
            eos_token_id=engine.eos_token_id,
        ).elapsed

    for _ in range(min(args.num_iters_warmup, 2)):
        once()
    res = summarize([once() for _ in range(args.num_iters)])
    return {"hf_avg_latency": res.avg_latency, "hf_latencies": res.latencies, "hf_percentiles": res.percentiles}
