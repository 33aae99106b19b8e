"""pkgd against its peers (vLLM's CPU build, llama.cpp) on one host, in one run: every figure of
each system measured in the same session, in alternating order, and printed as pkgd / peer
ratios.

Figures (SmolLM2-135M-Instruct; details in README.md beside this file):
  offline    256 x (128 -> 128) output tokens/s (pkgd bench throughput, vllm bench throughput)
  serve      1 / 16 / 64 concurrent streams of 128 -> 128, one load generator (pkgd bench
             serve) for every server: output tokens/s, median and p99 TTFT, median TPOT
  decode     single-stream decode tokens/s: in the engine (pkgd's single-stream run,
             llama-bench tg128) and through each server (1 / median TPOT at 1 stream)
  cold       seconds from starting the server to its first completion
  rss        peak RSS (and PSS) of each server's process tree over its life, 64 streams included
  ppl        perplexity of a fixed text, llama-perplexity's method (pkgd vs llama-perplexity)

With --repeats N every system runs N times, interleaved (pkgd, vLLM, llama.cpp, pkgd, ...);
the best of each is reported (highest throughput, lowest latency and cold start, highest
memory peak). Results also go to .work/results/summary-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import perplexity  # noqa: E402
import systems  # noqa: E402
from servers import Server, free_port  # noqa: E402

# metric -> (label, unit, better): better "max" or "min"; "max" peaks for memory (worst seen)
METRICS = {
    "offline_tok_s": ("offline 256 x 128->128 output tok/s", "tok/s", "max"),
    "decode_engine_tok_s": ("single-stream decode in the engine", "tok/s", "max"),
    "cold_start_s": ("cold start to first completion", "s", "min"),
    "peak_rss_gb": ("peak RSS of the process tree", "GB", "min"),
    "peak_pss_gb": ("peak PSS of the process tree", "GB", "min"),
    "ppl": ("perplexity, fixed text (llama-perplexity's method)", "", "min"),
}


def add_serve_metrics(concurrency: int) -> None:
    c = concurrency
    METRICS.setdefault(f"serve{c}_tok_s", (f"serve {c} streams: output tok/s", "tok/s", "max"))
    METRICS.setdefault(f"serve{c}_ttft_med_s", (f"serve {c} streams: median TTFT", "s", "min"))
    METRICS.setdefault(f"serve{c}_ttft_p99_s", (f"serve {c} streams: p99 TTFT", "s", "min"))
    METRICS.setdefault(f"serve{c}_tpot_med_ms", (f"serve {c} streams: median TPOT", "ms", "min"))
    if c == 1:
        METRICS.setdefault("serve1_decode_tok_s", ("single-stream decode through the server (1/TPOT)", "tok/s", "max"))


# what one system's failed command raises; the others' figures are still reported
RUN_FAILURES = (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError)

REPEAT_BEST = {"peak_rss_gb": max, "peak_pss_gb": max}  # memory: the worst peak seen


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


def run(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float,
    log_file: Path,
    stdout_only: bool = False,
    ok_codes: tuple[int, ...] = (0,),
) -> str:
    """Run to completion; its output to ``log_file``; returns stdout (and stderr after it unless
    ``stdout_only``). Raises `RuntimeError` on an exit code not in ``ok_codes``."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        argv,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    log_file.write_text(f"$ {shlex.join(argv)}\n{r.stdout}\n{r.stderr}")
    if r.returncode not in ok_codes:
        raise RuntimeError(f"{Path(argv[0]).name} exited {r.returncode}; see {log_file}")
    return r.stdout if stdout_only else r.stdout + r.stderr


class Results:
    def __init__(self) -> None:
        self.values: dict[str, dict[str, list[float]]] = {}
        self.errors: list[str] = []

    def add(self, system: str, metric: str, value: float | None) -> None:
        if value is not None:
            self.values.setdefault(system, {}).setdefault(metric, []).append(float(value))

    def best(self, system: str, metric: str) -> float | None:
        vals = self.values.get(system, {}).get(metric)
        if not vals:
            return None
        pick = REPEAT_BEST.get(metric) or (max if METRICS[metric][2] == "max" else min)
        return pick(vals)


def offline(args, p: systems.Paths, res: Results, rep: int, sysname: str) -> None:
    out = p.work / "results" / f"offline-{sysname}-{rep}.json"
    n, i, o = args.offline_prompts, args.input_len, args.output_len
    if sysname.startswith("pkgd"):
        run(
            systems.pkgd_offline(p, out, n, i, o, args.pkgd_config_for(sysname), single_stream=True),
            timeout=args.timeout,
            log_file=out.with_suffix(".log"),
        )
        fig = json.loads(out.read_text())
        res.add(sysname, "offline_tok_s", _find(fig, "output_tokens_per_s"))
        res.add(sysname, "decode_engine_tok_s", _find(fig, "single_stream_decode_tokens_per_s"))
    elif sysname.startswith("vllm"):
        run(
            systems.vllm_offline(p, out, n, i, o, sysname.split("-")[1]),
            env=systems.VLLM_ENV,
            timeout=args.timeout,
            log_file=out.with_suffix(".log"),
        )
        fig = json.loads(out.read_text())
        res.add(sysname, "offline_tok_s", fig["num_requests"] * o / fig["elapsed_time"])
    elif sysname == "llama.cpp":
        text = run(systems.llama_bench(p, i, o), timeout=args.timeout, log_file=out.with_suffix(".log"))
        for row in json.loads(text[text.index("[") : text.rindex("]") + 1]):
            if row.get("n_gen") and not row.get("n_prompt"):
                res.add(sysname, "decode_engine_tok_s", row["avg_ts"])


def _find(fig: dict, key: str):
    """``key`` anywhere in a nested JSON object (the first found, depth first)."""
    if key in fig:
        return fig[key]
    for v in fig.values():
        if isinstance(v, dict) and (found := _find(v, key)) is not None:
            return found
    return None


def serve(args, p: systems.Paths, res: Results, rep: int, sysname: str) -> None:
    port = free_port()
    if sysname.startswith("pkgd"):
        argv, env = systems.pkgd_serve(p, port, args.pkgd_config_for(sysname))
    elif sysname.startswith("vllm"):
        argv, env = systems.vllm_serve(p, port, sysname.split("-")[1])
    else:
        argv, env = systems.llama_serve(p, port, max(args.concurrency), args.input_len + args.output_len + 16)
    tag = f"{sysname}-{rep}"
    with Server(sysname, argv, port, p.work / "results" / f"server-{tag}.log", env) as server:
        res.add(sysname, "cold_start_s", server.start(timeout=args.start_timeout))
        log(f"{sysname}: first completion after {server.cold_start_s:.1f} s")
        for c in args.concurrency:
            out = p.work / "results" / f"serve-{tag}-c{c}.json"
            n = max(args.min_serve_prompts, args.prompts_per_stream * c)
            run(
                [
                    str(p.pkgd),
                    "bench",
                    "serve",
                    "--base-url",
                    server.base_url,
                    "--num-prompts",
                    str(n),
                    "--max-concurrency",
                    str(c),
                    "--input-len",
                    str(args.input_len),
                    "--output-len",
                    str(args.output_len),
                    "--output-json",
                    str(out),
                ],
                timeout=args.timeout,
                log_file=out.with_suffix(".log"),
                ok_codes=(0, 1),  # 1: some requests failed; the figures count them, see below
            )
            fig = json.loads(out.read_text())
            if fig["failed"]:
                res.errors.append(f"{sysname} at {c} streams: {fig['failed']} failed: {fig['errors']}")
            res.add(sysname, f"serve{c}_tok_s", fig["output_tokens_per_s"])
            res.add(sysname, f"serve{c}_ttft_med_s", fig["ttft_s"]["median"])
            res.add(sysname, f"serve{c}_ttft_p99_s", fig["ttft_s"]["p99"])
            res.add(sysname, f"serve{c}_tpot_med_ms", fig["tpot_s"]["median"] * 1e3)
            if c == 1 and fig["tpot_s"]["median"] > 0:
                res.add(sysname, "serve1_decode_tok_s", 1.0 / fig["tpot_s"]["median"])
            log(f"{sysname} {c} streams: {fig['output_tokens_per_s']:.1f} tok/s")
        res.add(sysname, "peak_rss_gb", server.sampler.peak_rss / 1e9)
        res.add(sysname, "peak_pss_gb", server.sampler.peak_pss / 1e9)


def ppl(args, p: systems.Paths, res: Results, names: list[str]) -> None:
    text = perplexity.write_text(p.work / "ppl-text.txt", args.ppl_chars)
    for sysname in names:
        try:
            _ppl_of(args, p, res, text, sysname)
        except RUN_FAILURES as e:
            res.errors.append(f"ppl {sysname}: {e}")
            log(f"ppl {sysname} failed: {e}")


def _ppl_of(args, p: systems.Paths, res: Results, text: Path, sysname: str) -> None:
    out = p.work / "results" / f"ppl-{sysname}.log"
    if sysname.startswith("pkgd"):
        line = run(
            systems.pkgd_perplexity(p, text, args.ppl_ctx, args.pkgd_config_for(sysname)),
            timeout=args.timeout,
            log_file=out,
            stdout_only=True,
        )
        res.add(sysname, "ppl", json.loads(line.strip().splitlines()[-1])["ppl"])
    elif sysname == "llama.cpp":
        res.add(
            sysname,
            "ppl",
            perplexity.parse_llama_perplexity(
                run(systems.llama_perplexity(p, text, args.ppl_ctx), timeout=args.timeout, log_file=out)
            )["ppl"],
        )


# ---- the report -----------------------------------------------------------------------------


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "GB" or v < 10:
        return f"{v:.2f}"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def report(res: Results, names: list[str], load: tuple[float, float]) -> list[str]:
    """The table (metric x system), then pkgd / peer ratios oriented so that > 1 = pkgd better."""
    lines = [
        f"pkgd vs peers on {os.uname().nodename}: {systems.cores()} cores; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end (ratios are within this run)",
        "",
    ]
    width = max(len(label) for label, _, _ in METRICS.values()) + 2
    lines.append("figure".ljust(width) + "".join(n.rjust(14) for n in names))
    for metric, (label, unit, _) in METRICS.items():
        row = [res.best(n, metric) for n in names]
        if all(v is None for v in row):
            continue
        lines.append(f"{label} ({unit})".ljust(width) if unit else label.ljust(width))
        lines[-1] += "".join(_fmt(v, unit).rjust(14) for v in row)
    pk = [n for n in names if n.startswith("pkgd")]
    peers = [n for n in names if not n.startswith("pkgd")]
    lines += [
        "",
        "ratios, pkgd / peer, > 1 = pkgd better (throughput: pkgd/peer; latency, memory, cold start: peer/pkgd):",
    ]
    for mine in pk:
        for metric, (label, _, better) in METRICS.items():
            a = res.best(mine, metric)
            parts = []
            for peer in peers:
                b = res.best(peer, metric)
                if a and b:
                    parts.append(f"{peer} {a / b if better == 'max' else b / a:.2f}x")
            if parts and metric != "ppl":
                lines.append(f"  {mine} {label}: " + ", ".join(parts))
            elif parts:
                lines.append(
                    f"  {mine} {label}: "
                    + ", ".join(
                        f"{peer} {res.best(peer, metric):.4f} vs {a:.4f}" for peer in peers if res.best(peer, metric)
                    )
                )
    lines += [f"error: {e}" for e in res.errors]
    return lines


# ---- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="benchmarks/peers/summary.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument(
        "--systems",
        default="pkgd,vllm-float32,vllm-bfloat16,llama.cpp",
        help="comma-separated: pkgd variants (see --pkgd), vllm-float32, vllm-bfloat16, llama.cpp",
    )
    ap.add_argument(
        "--pkgd",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE[,KEY=VALUE]",
        help="a pkgd variant with config overrides, e.g. pkgd-bf16=model.dtype=bfloat16 (add NAME to --systems "
        "or it is appended); 'pkgd' alone runs the defaults",
    )
    ap.add_argument(
        "--only",
        default="offline,serve,ppl",
        help="which parts: offline (also the single-stream decode "
        "in the engine), serve (also cold start, RSS, decode through the server), ppl",
    )
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs of every system; the best is reported")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompts-per-stream", type=int, default=4, help="serving requests = this x concurrency")
    ap.add_argument("--min-serve-prompts", type=int, default=8)
    ap.add_argument("--offline-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ppl-ctx", type=int, default=512)
    ap.add_argument("--ppl-chars", type=int, default=60_000)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds any one command may take")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to answer first")
    args = ap.parse_args(argv)
    variants = {"pkgd": []}
    for spec in args.pkgd:
        name, _, overrides = spec.partition("=")
        variants[name] = [o for o in overrides.split(",") if o]
    names = [n for n in args.systems.split(",") if n]
    names += [n for n in variants if n not in names and n != "pkgd"]
    args.names = names
    args.pkgd_config_for = lambda name: variants.get(name, [])
    args.parts = set(args.only.split(","))
    for c in args.concurrency:
        add_serve_metrics(c)
    return args


def installed(p: systems.Paths, name: str) -> bool:
    if name.startswith("vllm"):
        return p.vllm.exists()
    if name == "llama.cpp":
        return all(p.tool(t).exists() for t in ("llama-bench", "llama-server", "llama-perplexity"))
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = systems.default_paths()
    missing = [n for n in args.names if not installed(p, n)]
    if missing:
        log(f"not installed, skipped: {', '.join(missing)} (benchmarks/peers/install_vllm.sh, install_llamacpp.sh)")
    names = [n for n in args.names if n not in missing]
    p.model_dir, p.gguf = systems.resolve_model_files(p.pkgd_py)
    log(f"model: {p.model_dir} (GGUF {p.gguf}); systems: {', '.join(names)}")
    res, load0, started = Results(), os.getloadavg()[0], time.time()
    for rep in range(args.repeats):
        for part, fn in (("offline", offline), ("serve", serve)):
            if part not in args.parts:
                continue
            for name in names:
                log(f"{part} {name} (run {rep + 1}/{args.repeats})")
                try:
                    fn(args, p, res, rep, name)
                except RUN_FAILURES as e:
                    res.errors.append(f"{part} {name} run {rep + 1}: {e}")
                    log(f"{part} {name} failed: {e}")
    if "ppl" in args.parts:
        ppl(args, p, res, [n for n in names if n.startswith("pkgd") or n == "llama.cpp"])
    lines = report(res, names, (load0, os.getloadavg()[0]))
    print("\n".join(lines))
    out = p.work / "results" / time.strftime("summary-%Y%m%d-%H%M%S.json", time.localtime(started))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "systems": names,
                "values": res.values,
                "errors": res.errors,
                "load_start": load0,
                "load_end": os.getloadavg()[0],
                "report": lines,
            },
            indent=2,
        )
    )
    print(f"\n(figures of every run: {out})")
    return 1 if res.errors else 0


if __name__ == "__main__":
    sys.exit(main())
