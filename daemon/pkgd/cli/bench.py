"""``pkgd bench throughput``: offline throughput of the engine (vLLM's ``vllm bench throughput``).

Prints, from one run: requests/s, output and total tokens/s, peak RSS of the engine; the
fp32 ``torch.mm`` FLOP/s and the roofline fraction ``2 × params × tokens ÷ time ÷ GEMM
FLOP/s``; a single-stream decode figure (1 request, 128 in / 128 out) against the memory
bandwidth bound ``read bandwidth ÷ weight bytes per token``, the bandwidth read between its
decode steps (`pkgd.benchmarks.hardware.BandwidthProbe`; each step against the bandwidth of its
own moment) and, for comparison, the best read just before and after it; and with
``--baseline hf`` the same prompts through Hugging Face ``generate()`` in static batches, with
the ratio.

Order matters for memory: the engine runs first and its peak RSS is read before the
micro-benchmarks and the HF model allocate anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from pkgd.benchmarks import plot
from pkgd.benchmarks.stats import latency_stats
from pkgd.cli.base import CLISubcommand

GB = 1e9

THROUGHPUT_DESCRIPTION = """\
Offline throughput of the engine (as vllm bench throughput), all in one process:
requests/s, output and total tokens/s and the engine's peak memory; the achieved FLOP/s
against a measured matrix multiply; one request alone (decode tokens/s against the bound
the memory bandwidth sets); with --baseline hf, the same prompts through transformers'
generate() and the ratio. Configuration flags and overrides (--model, --max-num-seqs 64,
cache.num_blocks=512) choose the engine as for pkgd serve."""

THROUGHPUT_EXAMPLES = """\
examples:
  pkgd bench throughput --num-prompts 64 --input-len 256 --output-len 64
  pkgd bench throughput --baseline hf --repeats 3 --output-json run.json --plot run.png
  pkgd bench throughput --compare run.json --plot compare.png   (against an earlier run)"""


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--num-prompts", type=int, default=256, help="number of requests")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="input and output lengths uniform in [len·(1−r), len·(1+r)]",
    )
    p.add_argument(
        "--output-len-range",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=None,
        help="output lengths uniform in [MIN, MAX] (mixed lengths); overrides --output-len",
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    p.add_argument(
        "--prompts",
        choices=["random", "fixed"],
        default="random",
        help="random token ids, or a fixed English paragraph tiled to the input length",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument(
        "--baseline",
        choices=["none", "hf"],
        default="none",
        help="hf: also run transformers generate() on the same prompts",
    )
    p.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the HF baseline")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run pkgd (and the baseline) this many times, alternating, and report the fastest "
        "of each: on a shared machine the quietest window is the closest to the truth",
    )
    p.add_argument("--skip-single-stream", action="store_true", help="skip the single-stream decode run")
    p.add_argument(
        "--single-stream-len",
        type=int,
        default=128,
        metavar="N",
        help="input and output tokens of the single-stream run",
    )
    p.add_argument("--skip-roofline", action="store_true", help="skip the GEMM and bandwidth measurements")
    p.add_argument(
        "--dtypes",
        default=None,
        metavar="LIST",
        help="comma-separated model.dtype values (auto, float32, bfloat16, float16): one engine each in this "
        "process, the workload (and single stream) through each in turn, --repeats times in alternating "
        "order; prints each one's output and single-stream tokens/s as ratios against the first",
    )
    p.add_argument(
        "--quantizations",
        default=None,
        metavar="LIST",
        help="comma-separated model.quantization values (auto, gguf, none): as --dtypes, one engine each (of a "
        "GGUF model: gguf keeps its weights quantized, none dequantizes them, auto decides by measurement), "
        "with their weight memory as ratios too",
    )
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="also spread the workload over N random LoRA adapters (PEFT files written to a temporary "
        "directory) and print their output tokens/s as a ratio against the base model alone, both in one "
        "engine with lora.max_loras = N, --repeats times alternating",
    )
    p.add_argument("--lora-rank", type=int, default=8, metavar="R", help="rank of the --lora adapters")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config keys when run as 'python -m pkgd.cli.bench' (under 'pkgd' the "
        "configuration flags and overrides, e.g. --max-num-seqs 64 or cache.num_blocks=512, "
        "are composed with every config layer instead)",
    )
    p.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    plot.add_plot_args(p)


def offline_llm(
    args: argparse.Namespace, dtype: str | None = None, quantization: str | None = None, lora: dict | None = None
) -> Any:
    """The offline `LLM` of a CLI command.

    Under ``pkgd`` the configuration is composed from every layer (packaged presets, system
    tree, environment, overrides and vLLM flags such as ``--model`` or ``--max-num-seqs``);
    run standalone, ``KEY=VALUE`` arguments (dotted keys) are applied to the defaults. Either
    way the engine uses every core unless ``parallel.cpu_threads`` is set. ``dtype`` and
    ``quantization`` replace ``model.dtype`` and ``model.quantization``; ``lora`` keys of the
    ``lora`` section.
    """
    from pkgd.offline.llm import LLM

    request = getattr(args, "compose_request", None)
    if request is not None:
        from pkgd.config.compose import compose

        config = compose(request).config
        update = {k: v for k, v in (("dtype", dtype), ("quantization", quantization)) if v is not None}
        if update:
            config = config.model_copy(update={"model": config.model.model_copy(update=update)})
        if lora:
            data = config.to_json_dict(reveal_secrets=True)
            config = type(config).model_validate({**data, "lora": {**data["lora"], **lora}})
        return LLM(config=config)
    kwargs: dict[str, Any] = {}
    for item in getattr(args, "overrides", None) or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{item!r}: expected KEY=VALUE")
        kwargs[key.strip()] = yaml.safe_load(value)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if quantization is not None:
        kwargs["quantization"] = quantization
    if lora:
        kwargs["lora"] = lora
    return LLM(**kwargs)


def run_throughput(args: argparse.Namespace) -> int:
    import torch

    from pkgd.benchmarks import hardware, throughput

    if args.dtypes or args.quantizations:
        return run_dtype_comparison(args)
    if args.lora:
        return run_lora_comparison(args)
    llm = offline_llm(args)
    engine = llm.engine
    torch.set_num_threads(llm.config.parallel.cpu_threads)
    tok = llm.get_tokenizer()
    workload = throughput.make_workload(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_size=engine.vocab_size,
        random_range_ratio=args.random_range_ratio,
        output_len_range=tuple(args.output_len_range) if args.output_len_range else None,
        prompt_kind=args.prompts,
        tokenizer=tok,
        seed=llm.config.model.seed,
    )
    # warm-up: first-call set-up must not count
    warm = throughput.make_workload(
        num_prompts=2, input_len=16, output_len=4, vocab_size=engine.vocab_size, tokenizer=tok
    )
    throughput.run_pkgd(llm, warm, ignore_eos=True)

    def pkgd_run() -> Any:
        return throughput.run_pkgd(
            llm, workload, ignore_eos=args.ignore_eos, temperature=args.temperature, use_tqdm=args.progress
        )

    runs = [pkgd_run()]
    peak_rss = hardware.peak_rss_bytes()  # before the micro-benchmarks and HF allocate anything
    single, bandwidth = None, 0.0
    if not args.skip_single_stream:
        # the bound's bandwidth, two ways: read between the decode steps (each step against
        # its own moment), and the best read just before and just after the run
        probe = None if args.skip_roofline else hardware.BandwidthProbe()
        if probe:
            bandwidth = hardware.read_bandwidth()
        single = throughput.run_single_stream(
            llm,
            input_len=args.single_stream_len,
            output_len=args.single_stream_len,
            vocab_size=engine.vocab_size,
            probe=probe.read if probe else None,
        )
        if probe:
            bandwidth = max(bandwidth, hardware.read_bandwidth())
        del probe
    hf_run = _hf_runner(llm, workload, args) if args.baseline == "hf" else None
    hf_runs = [hf_run()] if hf_run else []
    for _ in range(args.repeats - 1):  # alternate, so both see the same load on a shared machine
        runs.append(pkgd_run())
        if hf_run:
            hf_runs.append(hf_run())
    res = min(runs, key=lambda r: r.elapsed)
    fig: dict[str, Any] = {
        "model": engine.model_name,
        "num_prompts": args.num_prompts,
        "threads": torch.get_num_threads(),
        "dtype": str(engine.model_runner.model_info.dtype),
        "num_kv_blocks": engine.num_kv_blocks,
        "kv_cache_dtype": str(getattr(engine.model_runner, "kv_dtype", "")).removeprefix("torch."),
        "prompt_tokens": res.prompt_tokens,
        "output_tokens": res.output_tokens,
        "elapsed_s": res.elapsed,
        "all_elapsed_s": [r.elapsed for r in runs],
        "requests_per_s": res.requests_per_s,
        "output_tokens_per_s": res.output_tokens_per_s,
        "total_tokens_per_s": res.total_tokens_per_s,
        "peak_rss_bytes": peak_rss,
        "num_preemptions": engine.stats().num_preemptions,
        "ttft_s": latency_stats(res.ttfts),
        "latency_s": latency_stats(res.latencies),
    }
    if single is not None:
        fig.update(single_stream_decode_tokens_per_s=single.decode_tokens_per_s, single_stream_ttft_s=single.ttft)
    if not args.skip_roofline:
        fig.update(_roofline(engine, res, single, bandwidth))
    if hf_runs:
        hf = min(hf_runs, key=lambda r: r.elapsed)
        fig.update(
            hf_batch_size=args.hf_batch_size,
            hf_elapsed_s=hf.elapsed,
            hf_all_elapsed_s=[r.elapsed for r in hf_runs],
            hf_requests_per_s=hf.requests_per_s,
            hf_output_tokens_per_s=hf.output_tokens_per_s,
            hf_total_tokens_per_s=hf.total_tokens_per_s,
        )
    _print_report(fig, args)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(fig, f, indent=2)
    llm.shutdown()
    runs = [plot.series_from_figures(fig, "pkgd")]
    if hf_runs:
        runs.append(plot.series_from_figures(fig, "HF generate()", prefix="hf_"))
    plot.report(
        runs + args.previous_runs,
        args.plot,
        title=f"pkgd bench throughput: {fig['model']}, {args.num_prompts} prompts, "
        f"{args.input_len} in / {args.output_len} out, {fig['threads']} threads",
    )
    return 0


def run_lora_comparison(args: argparse.Namespace) -> int:
    """``--lora N``: base model alone vs the workload spread over N adapters
    (`pkgd.benchmarks.lora`), one engine, alternating runs."""
    import torch

    from pkgd.benchmarks import lora, throughput

    if args.lora < 1 or args.lora_rank < 1:
        raise SystemExit("--lora and --lora-rank must be at least 1")
    llm = offline_llm(args, lora={"enable_lora": True, "max_loras": args.lora, "max_lora_rank": args.lora_rank})
    torch.set_num_threads(llm.config.parallel.cpu_threads)
    engine = llm.engine
    workload = throughput.make_workload(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_size=engine.vocab_size,
        random_range_ratio=args.random_range_ratio,
        prompt_kind=args.prompts,
        tokenizer=llm.get_tokenizer(),
        seed=llm.config.model.seed,
    )
    result = lora.compare(llm, workload, args.lora, rank=args.lora_rank, repeats=args.repeats, ignore_eos=True)
    fig = {
        "model": engine.model_name,
        "num_prompts": args.num_prompts,
        "max_num_seqs": llm.config.scheduler.max_num_seqs,
        "threads": torch.get_num_threads(),
        "lora_adapters": args.lora,
        "lora_rank": args.lora_rank,
        "base_output_tokens_per_s": result.base.output_tokens_per_s,
        "lora_output_tokens_per_s": result.lora.output_tokens_per_s,
        "lora_vs_base": result.ratio,
        "base_all_elapsed_s": result.all_base_s,
        "lora_all_elapsed_s": result.all_lora_s,
    }
    print(f"Model: {fig['model']}  prompts: {args.num_prompts}  max_num_seqs: {fig['max_num_seqs']}  "
          f"threads: {fig['threads']}")  # fmt: skip
    print(f"Base model alone:        {result.base.output_tokens_per_s:9.1f} output tokens/s")
    print(f"{args.lora} LoRA adapters (r={args.lora_rank}): {result.lora.output_tokens_per_s:9.1f} output tokens/s")
    print(f"LoRA / base:             {result.ratio:9.3f}x")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(fig, f, indent=2)
    llm.shutdown()
    return 0


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "gguf", "none")


def run_dtype_comparison(args: argparse.Namespace) -> int:
    """``--dtypes`` / ``--quantizations``: one engine per value, compared in one run
    (`pkgd.benchmarks.dtype_compare`)."""
    import torch

    from pkgd.benchmarks import dtype_compare, throughput

    if args.dtypes and args.quantizations:
        raise SystemExit("--dtypes and --quantizations: one at a time")
    flag, allowed, given = (
        ("--dtypes", DTYPES, args.dtypes) if args.dtypes else ("--quantizations", QUANTIZATIONS, args.quantizations)
    )
    names = [d.strip() for d in given.split(",") if d.strip()]
    bad = [d for d in names if d not in allowed]
    if bad or len(set(names)) != len(names) or not names:
        raise SystemExit(f"{flag}: each of {', '.join(allowed)} at most once, got {given!r}")
    if args.dtypes:
        llms = {d: offline_llm(args, d) for d in names}
    else:
        llms = {f"quant={q}": offline_llm(args, quantization=q) for q in names}
    first = next(iter(llms.values()))
    torch.set_num_threads(first.config.parallel.cpu_threads)
    engine, tok = first.engine, first.get_tokenizer()
    workload = throughput.make_workload(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        vocab_size=engine.vocab_size,
        random_range_ratio=args.random_range_ratio,
        output_len_range=tuple(args.output_len_range) if args.output_len_range else None,
        prompt_kind=args.prompts,
        tokenizer=tok,
        seed=first.config.model.seed,
    )
    warm = throughput.make_workload(
        num_prompts=2, input_len=16, output_len=4, vocab_size=engine.vocab_size, tokenizer=tok
    )
    for llm in llms.values():
        throughput.run_pkgd(llm, warm, ignore_eos=True)
    rows = dtype_compare.compare_dtypes(
        llms,
        workload,
        repeats=args.repeats,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        single_stream_len=None if args.skip_single_stream else args.single_stream_len,
        vocab_size=engine.vocab_size,
        progress=(lambda m: print(m, file=sys.stderr, flush=True)) if args.progress else (lambda _: None),
    )
    print(
        f"pkgd bench throughput {flag}: {engine.model_name}, {args.num_prompts} prompts, input {args.input_len}, "
        f"output {args.output_len}{' (ignore_eos)' if args.ignore_eos else ''}, {torch.get_num_threads()} threads, "
        f"fastest of {args.repeats} alternating run(s) each"
    )
    print("\n".join(dtype_compare.format_rows(rows)))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"dtypes": rows}, f, indent=2)
    for llm in llms.values():
        llm.shutdown()
    return 0


def _roofline(engine: Any, res: Any, single: Any, bandwidth: float) -> dict[str, Any]:
    """GEMM FLOP/s and achieved FLOP/s; with a single-stream run, its bound from ``bandwidth``
    (bytes/s read around that run)."""
    from pkgd.benchmarks import hardware
    from pkgd.benchmarks.roofline import count_parameters, dtype_bytes

    info = engine.model_runner.model_info
    params = getattr(info, "num_params", None) or count_parameters(engine.model_files.model_dir)
    fig: dict[str, Any] = {"parameters": params, "gemm_flops": hardware.gemm_flops()}
    fig["achieved_flops"] = 2 * params * (res.prompt_tokens + res.output_tokens) / res.elapsed
    fig["roofline_fraction"] = fig["achieved_flops"] / fig["gemm_flops"]
    if single is not None:
        fig["weight_bytes_per_token"] = params * dtype_bytes(info.dtype)
        fig["read_bandwidth_bytes_per_s"] = single.paced_bandwidth or bandwidth
        fig["bandwidth_bound_tokens_per_s"] = fig["read_bandwidth_bytes_per_s"] / fig["weight_bytes_per_token"]
        fig["single_stream_fraction"] = single.decode_tokens_per_s / fig["bandwidth_bound_tokens_per_s"]
        fig["best_read_bandwidth_bytes_per_s"] = bandwidth
        fig["best_read_bound_tokens_per_s"] = bandwidth / fig["weight_bytes_per_token"]
        fig["single_stream_fraction_of_best_read"] = single.decode_tokens_per_s / fig["best_read_bound_tokens_per_s"]
    return fig


def _hf_runner(llm: Any, workload: Any, args: argparse.Namespace) -> Any:
    """Load the HF model once; returns a function running the workload on it."""
    from pkgd.benchmarks.hf_baseline import load_hf_model, run_hf

    engine = llm.engine
    from pkgd.model_files.resolve import ensure_float_weights

    files = engine.model_files
    model_dir = getattr(files, "model_dir", None)
    if model_dir is None:
        raise SystemExit("--baseline hf needs a model directory with safetensors")
    ensure_float_weights(files)  # a GGUF served quantized has no float copy until now
    model = load_hf_model(model_dir)
    tok = llm.get_tokenizer()
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (engine.eos_token_id or 0)
    return lambda: run_hf(
        model,
        workload,
        batch_size=args.hf_batch_size,
        ignore_eos=args.ignore_eos,
        pad_token_id=pad,
        eos_token_id=engine.eos_token_id,
    )


def _print_report(fig: dict[str, Any], args: argparse.Namespace) -> None:
    out_desc = (
        f"{args.output_len_range[0]}-{args.output_len_range[1]}" if args.output_len_range else str(args.output_len)
    )
    print(
        f"pkgd bench throughput: {fig['model']}, {args.num_prompts} prompts ({args.prompts}), input {args.input_len}, "
        f"output {out_desc}{' (ignore_eos)' if args.ignore_eos else ''}, range ratio {args.random_range_ratio}, "
        f"dtype {fig['dtype']}, {fig['threads']} threads, {fig['num_kv_blocks']} KV blocks ({fig['kv_cache_dtype']})"
    )
    print(
        f"Throughput: {fig['requests_per_s']:.2f} requests/s, {fig['total_tokens_per_s']:.1f} total tokens/s, "
        f"{fig['output_tokens_per_s']:.1f} output tokens/s ({fig['output_tokens']} output tokens in "
        f"{fig['elapsed_s']:.1f} s, "
        f"runs {', '.join(f'{t:.1f}' for t in fig['all_elapsed_s'])} s; {fig['num_preemptions']} preemptions)"
    )
    for key, label in (("ttft_s", "TTFT"), ("latency_s", "Latency")):  # every request arrives at the start
        st = fig[key]
        print(f"{label:8s} median {st['median']:7.2f} s   mean {st['mean']:7.2f} s   p99 {st['p99']:7.2f} s")
    print(f"Peak RSS (engine, before baselines): {fig['peak_rss_bytes'] / GB:.2f} GB")
    if "gemm_flops" in fig:
        print(f"GEMM (torch.mm fp32 2048x2048x2048): {fig['gemm_flops'] / 1e9:.1f} GFLOP/s")
        print(
            f"Roofline: 2 x {fig['parameters'] / 1e6:.1f}M params x "
            f"{fig['prompt_tokens'] + fig['output_tokens']} tokens "
            f"/ {fig['elapsed_s']:.1f} s = {fig['achieved_flops'] / 1e9:.1f} GFLOP/s = "
            f"{100 * fig['roofline_fraction']:.1f}% of GEMM"
        )
    if "single_stream_decode_tokens_per_s" in fig:
        n = args.single_stream_len
        line = (
            f"Single stream ({n} in / {n} out): decode {fig['single_stream_decode_tokens_per_s']:.1f} tokens/s, "
            f"TTFT {fig['single_stream_ttft_s']:.3f} s"
        )
        if "bandwidth_bound_tokens_per_s" in fig:
            line += (
                f"; bandwidth bound {fig['bandwidth_bound_tokens_per_s']:.1f} tokens/s "
                f"({fig['read_bandwidth_bytes_per_s'] / GB:.1f} GB/s read between its steps / "
                f"{fig['weight_bytes_per_token'] / 1e6:.0f} MB per token) = "
                f"{100 * fig['single_stream_fraction']:.0f}% of the bound"
            )
        print(line)
        if "best_read_bound_tokens_per_s" in fig:
            print(
                "  against the best read just before/after it "
                f"({fig['best_read_bandwidth_bytes_per_s'] / GB:.1f} GB/s, "
                f"bound {fig['best_read_bound_tokens_per_s']:.1f} tokens/s): "
                f"{100 * fig['single_stream_fraction_of_best_read']:.0f}%"
            )
    if "hf_output_tokens_per_s" in fig:
        print(
            f"HF generate() static batches of {fig['hf_batch_size']}: {fig['hf_requests_per_s']:.2f} requests/s, "
            f"{fig['hf_total_tokens_per_s']:.1f} total tokens/s, {fig['hf_output_tokens_per_s']:.1f} output tokens/s "
            f"(runs {', '.join(f'{t:.1f}' for t in fig['hf_all_elapsed_s'])} s)"
        )
        print(f"pkgd / HF output tokens/s: {fig['output_tokens_per_s'] / fig['hf_output_tokens_per_s']:.2f}x")


class BenchSubcommand(CLISubcommand):
    """``pkgd bench {throughput,serve,latency}``."""

    name = "bench"
    help = "benchmark the offline engine (throughput, latency) or a running server (serve)"

    def subparser_init(self, subparsers: Any) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help=self.help, description=self.help)
        sub = parser.add_subparsers(dest="bench_command", required=True, metavar="{throughput,serve,latency}")
        t = sub.add_parser(
            "throughput",
            help="offline throughput of the engine (vllm bench throughput)",
            description=THROUGHPUT_DESCRIPTION,
            epilog=THROUGHPUT_EXAMPLES,
        )
        add_throughput_args(t)
        t.set_defaults(bench_dispatch=run_throughput)
        from pkgd.cli import bench_serve  # light: argparse only until it runs

        s = sub.add_parser(
            "serve",
            help="load a running OpenAI-compatible server (vllm bench serve)",
            description=bench_serve.DESCRIPTION,
            epilog=bench_serve.EXAMPLES,
        )
        bench_serve.add_serve_args(s)
        s.set_defaults(bench_dispatch=bench_serve.run_serve)
        from pkgd.cli import bench_latency  # light: argparse only until it runs

        lat = sub.add_parser(
            "latency",
            help="latency of one batch (vllm bench latency)",
            description=bench_latency.DESCRIPTION,
            epilog=bench_latency.EXAMPLES,
        )
        bench_latency.add_latency_args(lat)
        lat.set_defaults(bench_dispatch=lambda a: bench_latency.run_latency(a, offline_llm))
        return parser

    def validate(self, args: argparse.Namespace) -> None:
        """``--plot`` without matplotlib, or a ``--compare`` file that is no earlier run, stops
        before the benchmark runs (exit 2); so does a configuration argument given to ``bench
        serve``, which reads none (but vllm bench serve's ``--host``, ``--port``, ``--model``)."""
        from pkgd.cli.main import UsageError

        try:
            args.previous_runs = plot.check_plot_args(args)
        except (plot.PlotUnavailable, ValueError) as e:
            raise UsageError(str(e)) from None
        request = getattr(args, "compose_request", None)
        if args.bench_command != "serve" or request is None:
            return
        from pkgd.cli import bench_serve

        try:
            unused = bench_serve.apply_target_flags(args, request.flags)
        except ValueError as e:
            raise UsageError(f"bench serve: {e}") from None
        unused += request.overrides
        for flag, value in (
            ("--config-dir", request.config_dir),
            ("--config-name", request.config_name),
            ("--config", request.vllm_config),
        ):
            if value:
                unused.append(f"{flag} {value}")
        if unused:
            raise UsageError(
                f"bench serve loads a running server and reads no configuration: {' '.join(unused)} "
                "(server settings go to pkgd serve; name the server with --base-url, or --host and --port)"
            )

    def cmd(self, args: argparse.Namespace) -> int:
        return args.bench_dispatch(args)


def cmd_init() -> list[BenchSubcommand]:
    return [BenchSubcommand()]


def main(argv: list[str] | None = None) -> int:
    """``python -m pkgd.cli.bench throughput …`` (the same as ``pkgd bench throughput …``)."""
    from pkgd.cli.parser import ArgumentParser

    parser = ArgumentParser(prog="pkgd")
    subparsers = parser.add_subparsers(dest="command", required=True)
    (cmd,) = cmd_init()
    cmd.subparser_init(subparsers)
    from pkgd.cli.main import UsageError

    args = parser.parse_command_line(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        cmd.validate(args)
    except UsageError as e:
        print(f"pkgd bench: error: {e}", file=sys.stderr)
        return 2
    return cmd.cmd(args)


if __name__ == "__main__":
    sys.exit(main())
