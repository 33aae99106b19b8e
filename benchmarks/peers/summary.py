"""pkgd against its peers (vLLM's CPU build, llama.cpp) on one host, in one run: every figure of
each system measured in the same session, in alternating order, and printed as pkgd / peer
ratios.

Figures (SmolLM2-135M-Instruct; details in README.md beside this file):
  offline     N x (128 -> 128) output tokens/s (pkgd bench throughput, vllm bench throughput)
  serve       1 / 16 / 64 concurrent streams of 128 -> 128 against every server, each level
              with both load generators: the light one (pkgd bench serve) and vllm bench
              serve: output tokens/s, median and p99 TTFT, median TPOT; every level of one
              server's life gets prompts of its own (a seed per level: no prefix-cache hits)
  decode      single-stream decode tokens/s: in the engine (pkgd's single-stream run,
              llama-bench tg128) and through each server (1 / median TPOT at 1 stream)
  cold        seconds from starting the server to its first completion (pkgd: warm caches,
              after a first start of the same instance, also reported)
  rss         peak RSS (and PSS) of each server's process tree during the top concurrency level
  contention  top-level throughput with a busy loop pinned to one core / without, per server
  ppl         perplexity of a fixed text, llama-perplexity's method (pkgd vs llama-perplexity)

The CPU share taken by processes outside the test is sampled during every phase and printed,
with a warning above 10% of the box. --quick: every ratio but ppl in at most ~20 minutes
(fewer prompts, 1 and 64 streams, vLLM in bfloat16 only, every command bounded).

With --repeats N every system runs N times, interleaved (pkgd, vLLM, llama.cpp, pkgd, ...);
the best of each is reported (highest throughput, lowest latency and cold start, highest
memory peak). Results also go to .work/results/summary-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import clients  # noqa: E402
import cpuload  # noqa: E402
import perplexity  # noqa: E402
import systems  # noqa: E402
from servers import Server, free_port  # noqa: E402

# metric -> (label, unit, better): better "max" or "min"; "max" peaks for memory (worst seen)
METRICS = {
    "offline_tok_s": ("offline N x 128->128 output tok/s", "tok/s", "max"),
    "decode_engine_tok_s": ("single-stream decode in the engine", "tok/s", "max"),
    "cold_start_s": ("cold start to first completion (warm caches)", "s", "min"),
    "first_start_s": ("first start of a fresh instance (weights converted)", "s", "min"),
    "peak_rss_gb": ("peak RSS of the process tree, top level", "GB", "min"),
    "peak_pss_gb": ("peak PSS of the process tree, top level", "GB", "min"),
    "ppl": ("perplexity, fixed text (llama-perplexity's method)", "", "min"),
}

SUFFIX = {"light": "", "vllm": "_vb"}
CLIENT_LABEL = {"light": "light client", "vllm": "vllm bench serve"}


def add_serve_metrics(concurrency: int, client: str) -> None:
    c, sfx, who = concurrency, SUFFIX[client], CLIENT_LABEL[client]
    METRICS.setdefault(f"serve{c}{sfx}_tok_s", (f"serve {c} streams, {who}: output tok/s", "tok/s", "max"))
    METRICS.setdefault(f"serve{c}{sfx}_ttft_med_s", (f"serve {c} streams, {who}: median TTFT", "s", "min"))
    METRICS.setdefault(f"serve{c}{sfx}_ttft_p99_s", (f"serve {c} streams, {who}: p99 TTFT", "s", "min"))
    METRICS.setdefault(f"serve{c}{sfx}_tpot_med_ms", (f"serve {c} streams, {who}: median TPOT", "ms", "min"))
    if c == 1:
        METRICS.setdefault(
            f"serve1{sfx}_decode_tok_s", (f"single stream through the server, {who} (1/TPOT)", "tok/s", "max")
        )


def add_contention_metrics(c: int) -> None:
    METRICS[f"quiet{c}_tok_s"] = (f"contention: {c} streams quiet, output tok/s", "tok/s", "max")
    METRICS[f"busy{c}_tok_s"] = (f"contention: {c} streams, busy loop on one core", "tok/s", "max")
    METRICS[f"busy{c}_tpot_med_ms"] = (f"contention: {c} streams busy, median TPOT", "ms", "min")
    METRICS["contention"] = (f"contention: busy / quiet {c}-stream throughput", "x", "max")


# what one system's failed command raises; the others' figures are still reported
RUN_FAILURES = (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError)

REPEAT_BEST = {"peak_rss_gb": max, "peak_pss_gb": max}  # memory: the worst peak seen


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


class Results:
    def __init__(self) -> None:
        self.values: dict[str, dict[str, list[float]]] = {}
        self.errors: list[str] = []
        self.others: list[tuple[str, str, float]] = []  # (system, phase, share of the box used by others)

    def add(self, system: str, metric: str, value: float | None) -> None:
        if value is not None:
            self.values.setdefault(system, {}).setdefault(metric, []).append(float(value))

    def best(self, system: str, metric: str) -> float | None:
        vals = self.values.get(system, {}).get(metric)
        if not vals:
            return None
        pick = REPEAT_BEST.get(metric) or (max if METRICS[metric][2] == "max" else min)
        return pick(vals)


class Ports:
    """Server ports: ``base``, ``base + 1``, ... in start order when ``--port-base`` is given
    (each checked free first: `RuntimeError` names a taken one), else any free port."""

    def __init__(self, base: int | None) -> None:
        self.base, self.used = base, 0

    def next(self) -> int:
        if self.base is None:
            return free_port()
        port = self.base + self.used
        self.used += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                raise RuntimeError(f"port {port} (--port-base {self.base} + {self.used - 1}) is taken: {e}") from e
        return port


def run(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float,
    log_file: Path,
    stdout_only: bool = False,
    ok_codes: tuple[int, ...] = (0,),
    track: tuple[set[int], set[int]] = (set(), set()),
    others: list[float] | None = None,
) -> str:
    """Run to completion in a session of its own; its output to ``log_file``; returns stdout
    (and stderr after it unless ``stdout_only``). The CPU share other processes took meanwhile
    (all but this command's session, ``track``'s sessions and pids, and this harness) is
    appended to ``others`` when given. Raises `RuntimeError` on an exit code not in
    ``ok_codes``, `subprocess.TimeoutExpired` after ``timeout`` s (the session killed)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sampler = cpuload.OthersSampler(set(track[0]), {os.getpid(), *track[1]})
    sampler.start()
    proc = subprocess.Popen(
        argv,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    sampler.add_session(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, err = proc.communicate()
        log_file.write_text(f"$ {shlex.join(argv)}\n(killed after {timeout:.0f} s)\n{out}\n{err}")
        sampler.stop()
        raise
    share = sampler.stop()
    if others is not None:
        others.append(share)
    log_file.write_text(f"$ {shlex.join(argv)}\n{out}\n{err}")
    if proc.returncode not in ok_codes:
        raise RuntimeError(f"{Path(argv[0]).name} exited {proc.returncode}; see {log_file}")
    return out if stdout_only else out + err


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _note_others(res: Results, system: str, phase: str, shares: list[float]) -> None:
    if not shares:
        return
    res.others.append((system, phase, shares[-1]))
    if shares[-1] > cpuload.WARN_SHARE:
        log(f"warning: other processes took {shares[-1]:.0%} of the box during {system} {phase}")


def offline(args, p: systems.Paths, res: Results, rep: int, sysname: str) -> None:
    out = p.work / "results" / f"offline-{sysname}-{rep}.json"
    n, i, o = args.offline_prompts, args.input_len, args.output_len
    shares: list[float] = []
    if sysname.startswith("pkgd"):
        inst = args.pkgd_instance(p, sysname)
        try:
            argv = systems.pkgd_offline(p, out, n, i, o, inst.config() + args.pkgd_config_for(sysname), True)
            if args.single_stream_len:
                argv[3:3] = ["--single-stream-len", str(args.single_stream_len)]
            run(argv, timeout=args.timeout, log_file=out.with_suffix(".log"), others=shares)
        finally:
            inst.close()
        fig = json.loads(out.read_text())
        res.add(sysname, "offline_tok_s", _find(fig, "output_tokens_per_s"))
        res.add(sysname, "decode_engine_tok_s", _find(fig, "single_stream_decode_tokens_per_s"))
    elif sysname.startswith("vllm"):
        run(
            systems.vllm_offline(p, out, n, i, o, sysname.split("-")[1]),
            env=systems.vllm_env(p),
            timeout=args.timeout,
            log_file=out.with_suffix(".log"),
            others=shares,
        )
        fig = json.loads(out.read_text())
        res.add(sysname, "offline_tok_s", fig["num_requests"] * o / fig["elapsed_time"])
    elif sysname == "llama.cpp":
        argv = systems.llama_bench(p, i, o) + ["-r", str(args.llama_bench_reps)]
        text = run(argv, timeout=args.timeout, log_file=out.with_suffix(".log"), others=shares)
        for row in json.loads(text[text.index("[") : text.rindex("]") + 1]):
            if row.get("n_gen") and not row.get("n_prompt"):
                res.add(sysname, "decode_engine_tok_s", row["avg_ts"])
    _note_others(res, sysname, "offline", shares)


def _find(fig: dict, key: str):
    """``key`` anywhere in a nested JSON object (the first found, depth first)."""
    if key in fig:
        return fig[key]
    for v in fig.values():
        if isinstance(v, dict) and (found := _find(v, key)) is not None:
            return found
    return None


def _server_argv(args, p: systems.Paths, sysname: str, port: int, inst) -> tuple[list[str], dict[str, str]]:
    if sysname.startswith("pkgd"):
        return systems.pkgd_serve(p, port, inst.config() + args.pkgd_config_for(sysname))
    if sysname.startswith("vllm"):
        return systems.vllm_serve(p, port, sysname.split("-")[1])
    return systems.llama_serve(p, port, max(args.concurrency), args.input_len + args.output_len + 16)


def serve(args, p: systems.Paths, res: Results, rep: int, sysname: str) -> None:
    """One server: (pkgd: a first start of a fresh instance, stopped), the timed start, every
    concurrency level with every client, then the contention phase."""
    tag = f"{sysname}-{rep}"
    inst = args.pkgd_instance(p, sysname) if sysname.startswith("pkgd") else None
    try:
        if inst is not None:
            # the instance's first start measures its own dtype choice into its own cache; the
            # timed start after it is pkgd's warm-cache start, as a restart sees it
            port = args.ports.next()
            argv, env = _server_argv(args, p, sysname, port, inst)
            with Server(sysname, argv, port, p.work / "results" / f"server-{tag}-first.log", env) as first:
                res.add(sysname, "first_start_s", first.start(timeout=args.start_timeout))
                log(f"{sysname}: first start of a fresh instance answered after {first.cold_start_s:.1f} s")
        port = args.ports.next()
        argv, env = _server_argv(args, p, sysname, port, inst)
        with Server(sysname, argv, port, p.work / "results" / f"server-{tag}.log", env) as server:
            res.add(sysname, "cold_start_s", server.start(timeout=args.start_timeout))
            log(f"{sysname}: first completion after {server.cold_start_s:.1f} s")
            _levels(args, p, res, tag, sysname, server)
            if args.contention:
                _contention(args, p, res, tag, sysname, server)
    finally:
        if inst is not None:
            inst.close()


def _levels(args, p: systems.Paths, res: Results, tag: str, sysname: str, server: Server) -> None:
    top = max(args.concurrency)
    for c in args.concurrency:
        n = max(args.min_serve_prompts, args.prompts_per_stream * c)
        if c == top:
            server.sampler.reset()  # the memory figure is this level's peak, not the start-up's
        for client in args.clients:
            level = clients.Level(c, n, args.input_len, args.output_len, clients.level_seed("serve", client, c))
            fig = _load(args, p, res, tag, sysname, server, client, level, f"c{c}", args.timeout)
            if fig is None:
                continue
            sfx = SUFFIX[client]
            res.add(sysname, f"serve{c}{sfx}_tok_s", fig.tok_s)
            res.add(sysname, f"serve{c}{sfx}_ttft_med_s", fig.ttft_med_s)
            res.add(sysname, f"serve{c}{sfx}_ttft_p99_s", fig.ttft_p99_s)
            res.add(sysname, f"serve{c}{sfx}_tpot_med_ms", fig.tpot_med_ms)
            if c == 1 and fig.tpot_med_ms > 0:
                res.add(sysname, f"serve1{sfx}_decode_tok_s", 1e3 / fig.tpot_med_ms)
            log(f"{sysname} {c} streams, {client} client: {fig.tok_s:.1f} tok/s")
        if c == top:
            res.add(sysname, "peak_rss_gb", server.sampler.peak_rss / 1e9)
            res.add(sysname, "peak_pss_gb", server.sampler.peak_pss / 1e9)


def _load(args, p, res, tag, sysname, server, client, level, label, timeout, busy: set[int] = frozenset()):
    """One load level with one client; its `clients.Figures`, or None (the failure recorded)."""
    out = p.work / "results" / f"serve-{tag}-{label}-{client}.json"
    out.unlink(missing_ok=True)
    if client == "light":
        argv, env = clients.light_argv(p.pkgd, server.base_url, level, out), {}
    else:
        argv = clients.vllm_argv(p.vllm, server.base_url, server.model, p.model_dir, level, out)
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    shares: list[float] = []
    try:
        run(
            argv,
            env=env,
            timeout=timeout,
            log_file=out.with_suffix(".log"),
            ok_codes=(0, 1),  # 1: some requests failed; the figures count them, see below
            track=({server.proc.pid}, set(busy)),
            others=shares,
        )
        fig = clients.read_figures(client, out)
    except RUN_FAILURES as e:
        res.errors.append(f"{sysname} {label} {client} client: {type(e).__name__}: {e}")
        log(f"{sysname} {label} {client} client failed: {e}")
        return None
    _note_others(res, sysname, f"{label} {client}", shares)
    if fig.failed:
        res.errors.append(f"{sysname} {label} {client} client: {fig.failed} failed: {fig.errors}")
    return fig


def _contention(args, p: systems.Paths, res: Results, tag: str, sysname: str, server: Server) -> None:
    """The top concurrency level, light client, quiet and then with a busy loop pinned to one
    core (each with its own prompts); their throughput ratio is the contention figure."""
    c = max(args.concurrency)
    shape = (c, args.contention_prompts or c, args.input_len, args.contention_output_len)
    quiet = _load(
        args,
        p,
        res,
        tag,
        sysname,
        server,
        "light",
        clients.Level(*shape, clients.level_seed("quiet", "light", c)),
        f"quiet{c}",
        args.timeout,
    )
    core = min(os.sched_getaffinity(0))
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        os.sched_setaffinity(loop.pid, {core})
        busy = _load(
            args,
            p,
            res,
            tag,
            sysname,
            server,
            "light",
            clients.Level(*shape, clients.level_seed("busy", "light", c)),
            f"busy{c}",
            args.contention_timeout,
            busy={loop.pid},
        )
    finally:
        loop.kill()
        loop.wait()
    if quiet is not None:
        res.add(sysname, f"quiet{c}_tok_s", quiet.tok_s)
    if busy is not None:
        res.add(sysname, f"busy{c}_tok_s", busy.tok_s)
        res.add(sysname, f"busy{c}_tpot_med_ms", busy.tpot_med_ms)
    if quiet is not None and busy is not None and quiet.tok_s > 0:
        res.add(sysname, "contention", busy.tok_s / quiet.tok_s)
        log(f"{sysname} contention: {busy.tok_s:.1f} / {quiet.tok_s:.1f} tok/s = {busy.tok_s / quiet.tok_s:.2f}")


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

    def head(label: str, unit: str) -> str:
        return f"{label} ({unit})" if unit and not label.endswith(unit) else label

    width = max(len(head(label, unit)) for label, unit, _ in METRICS.values()) + 2
    lines.append("figure".ljust(width) + "".join(n.rjust(14) for n in names))
    for metric, (label, unit, _) in METRICS.items():
        row = [res.best(n, metric) for n in names]
        if all(v is None for v in row):
            continue
        lines.append(head(label, unit).ljust(width))
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
    lines += others_lines(res.others)
    lines += [f"error: {e}" for e in res.errors]
    return lines


def others_lines(others: list[tuple[str, str, float]]) -> list[str]:
    """The CPU share other processes took during each phase, and a warning naming the phases
    above `cpuload.WARN_SHARE` of the box (their figures are not comparable)."""
    if not others:
        return []
    lines = ["", "CPU taken by other processes during each phase, share of the box (whole box = 100%):"]
    by_sys: dict[str, list[str]] = {}
    for system, phase, share in others:
        by_sys.setdefault(system, []).append(f"{phase} {share:.0%}")
    lines += [f"  {system}: " + ", ".join(parts) for system, parts in by_sys.items()]
    noisy = [f"{system} {phase} ({share:.0%})" for system, phase, share in others if share > cpuload.WARN_SHARE]
    if noisy:
        lines.append(
            f"WARNING: other processes took more than {cpuload.WARN_SHARE:.0%} of the box during: "
            + ", ".join(noisy)
            + "; those figures and their ratios are not representative"
        )
    return lines


# ---- main -------------------------------------------------------------------------------------


QUICK = {
    "systems": "pkgd,vllm-bfloat16,llama.cpp",
    "only": "offline,serve",
    "concurrency": [1, 64],
    "prompts_per_stream": 1,
    "min_serve_prompts": 8,
    "offline_prompts": 64,
    "single_stream_len": 64,
    "llama_bench_reps": 2,
    "order": "system",
    "contention_prompts": 64,
    "contention_output_len": 32,
    "timeout": 300.0,
    "contention_timeout": 300.0,
    "start_timeout": 300.0,
}
"""--quick's defaults (any option given beside --quick wins): about 20 minutes on 2 cores once
the peers are installed; every command bounded so one stuck phase costs at most its timeout."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="benchmarks/peers/summary.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--quick", action="store_true", help="every ratio but ppl in ~20 minutes (see QUICK in the source)")
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
        "in the engine), serve (also cold start, RSS, decode through the server, contention), ppl",
    )
    ap.add_argument(
        "--clients", default="light,vllm", help="load generators: light (pkgd bench serve), vllm (vllm bench serve)"
    )
    ap.add_argument("--port-base", type=int, default=None, help="servers listen on this port and the next ones")
    ap.add_argument(
        "--order",
        choices=("part", "system"),
        default="part",
        help="part: every system's offline run, then every system's serving; system: each system's parts back to back",
    )
    ap.add_argument("--repeats", type=int, default=1, help="interleaved runs of every system; the best is reported")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompts-per-stream", type=int, default=4, help="serving requests = this x concurrency")
    ap.add_argument("--min-serve-prompts", type=int, default=8)
    ap.add_argument("--offline-prompts", type=int, default=256)
    ap.add_argument("--single-stream-len", type=int, default=None, help="pkgd's single-stream run (its default)")
    ap.add_argument("--llama-bench-reps", type=int, default=5)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--no-contention", dest="contention", action="store_false", help="skip the busy-loop phase (on by default)"
    )
    ap.add_argument("--contention-prompts", type=int, default=None, help="contention phase requests (default 2 x top)")
    ap.add_argument("--contention-output-len", type=int, default=64)
    ap.add_argument("--contention-timeout", type=float, default=1200, help="seconds the busy phase may take")
    ap.add_argument("--ppl-ctx", type=int, default=512)
    ap.add_argument("--ppl-chars", type=int, default=60_000)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds any one command may take")
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to answer first")
    pre, _ = ap.parse_known_args(argv)
    if pre.quick:
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    if args.contention_prompts is None:
        args.contention_prompts = 2 * max(args.concurrency)
    variants = {"pkgd": []}
    for spec in args.pkgd:
        name, _, overrides = spec.partition("=")
        variants[name] = [o for o in overrides.split(",") if o]
    names = [n for n in args.systems.split(",") if n]
    names += [n for n in variants if n not in names and n != "pkgd"]
    args.names = names
    args.pkgd_config_for = lambda name: variants.get(name, [])
    args.parts = set(args.only.split(","))
    args.clients = [c for c in args.clients.split(",") if c]
    unknown = [c for c in args.clients if c not in clients.CLIENTS]
    if unknown:
        ap.error(f"--clients: unknown {', '.join(unknown)} (choose from {', '.join(clients.CLIENTS)})")
    for c in args.concurrency:
        for client in args.clients:
            add_serve_metrics(c, client)
    if args.contention:
        add_contention_metrics(max(args.concurrency))
    args.ports = Ports(args.port_base)
    return args


def schedule(order: str, repeats: int, parts: list[str], names: list[str]) -> list[tuple[int, str, str]]:
    """``(repeat, part, system)`` in run order. ``part``: every system's offline run, then every
    system's serving run (a part's figures close together in time); ``system``: each system's
    parts back to back, the systems in the given order (a peer still installing in the
    background is measured last)."""
    if order == "part":
        return [(r, part, n) for r in range(repeats) for part in parts for n in names]
    return [(r, part, n) for r in range(repeats) for n in names for part in parts]


def installed(p: systems.Paths, name: str) -> bool:
    if name.startswith("vllm"):
        return p.vllm.exists()
    if name == "llama.cpp":
        return all(p.tool(t).exists() for t in ("llama-bench", "llama-server", "llama-perplexity"))
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res, load0, started = Results(), os.getloadavg()[0], time.time()
    p = systems.default_paths()
    names = args.names
    missing = [n for n in names if not installed(p, n)]
    if missing:
        log(f"not installed yet: {', '.join(missing)} (checked again before each of its phases)")
    weights, kernels = p.work / "pkgd-weights", p.work / "pkgd-kernels"
    p.model_dir, p.gguf = systems.resolve_model_files(p.pkgd_py, weights)
    args.pkgd_instance = lambda paths, name: systems.PkgdInstance(paths.work, name, weights, kernels)
    if "vllm" in args.clients and not p.vllm.exists():
        log("vllm bench serve not installed (benchmarks/peers/install_vllm.sh): light client only")
        args.clients.remove("vllm")
    log(f"model: {p.model_dir} (GGUF {p.gguf}); systems: {', '.join(names)}; clients: {', '.join(args.clients)}")
    if preloads := systems.allocator_preloads(p.vllm_venv):
        log(f"vLLM preloads: {', '.join(preloads)}")
    elif any(n.startswith("vllm") for n in names):
        log("vLLM: no TCMalloc / Intel OpenMP found to preload (its CPU docs recommend TCMalloc)")
    for rep, part, name in schedule(
        args.order, args.repeats, [x for x in ("offline", "serve") if x in args.parts], names
    ):
        if not installed(p, name):
            res.errors.append(f"{part} {name} run {rep + 1}: not installed (install_vllm.sh, install_llamacpp.sh)")
            log(f"{part} {name}: not installed, skipped")
            continue
        log(f"{part} {name} (run {rep + 1}/{args.repeats})")
        try:
            (offline if part == "offline" else serve)(args, p, res, rep, name)
        except RUN_FAILURES as e:
            res.errors.append(f"{part} {name} run {rep + 1}: {e}")
            log(f"{part} {name} failed: {e}")
    if "ppl" in args.parts:
        ppl(args, p, res, [n for n in names if (n.startswith("pkgd") or n == "llama.cpp") and installed(p, n)])
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
                "others_cpu_share": res.others,
                "wall_s": time.time() - started,
                "load_start": load0,
                "load_end": os.getloadavg()[0],
                "report": lines,
            },
            indent=2,
        )
    )
    print(f"\n(figures of every run: {out}; wall time {time.time() - started:.0f} s)")
    return 1 if res.errors else 0


if __name__ == "__main__":
    sys.exit(main())
