"""The speed a user feels through the server, in one run on the default model: what the server
path adds per token (at 1 and 64 streams), what a busy core costs, and what the default
``model.quantization`` gives one stream against ``none``.

Engine: ``pkgd bench latency`` (the offline engine, no server) on a batch of B prompts, once
with ``--output-len O`` and once with 1; their difference over O - 1 is one decode step of a
batch of B, the engine's time per output token of each request. Server: ``pkgd serve`` with
``pkgd bench serve`` keeping B requests in flight (at least 8 requests in all, same lengths); its
median TPOT is the time per output token a client sees, engine step → output IPC →
detokenizer → SSE frame → socket. The ratio server / engine is the server path's cost (1.00 =
free). Also printed: the API servers' and the engine core's CPU seconds per output token
during the server phase (the API process competes with the engine for the same cores).

Contention: the largest B again on the same server while a busy loop (``while True: pass``)
holds the last core this process may use; output tokens/s busy / quiet. Quantization: a
second server with ``model.quantization=none`` (the GGUF dequantized) runs the single stream;
the default's single-stream tokens/s (1 / TPOT) against it.

    python benchmarks/server_overhead.py                 # B = 1 and 64, 32 -> 128 tokens
    python benchmarks/server_overhead.py --streams 1,16 --output-len 64 --no-busy --no-quantization
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PKGD = str(Path(sys.executable).with_name("pkgd"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from contention import _busy_loop, _free_port, _tok_s, _wait_ready  # noqa: E402


def _latency(batch: int, input_len: int, output_len: int, iters: int, work: Path) -> float:
    out = work / f"lat-{batch}-{output_len}.json"
    cmd = [
        PKGD, "bench", "latency", "--batch-size", str(batch), "--input-len", str(input_len),
        "--output-len", str(output_len), "--num-iters", str(iters), "--num-iters-warmup", "1",
        "--temperature", "0", "--output-json", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return float(json.loads(out.read_text())["avg_latency"])


def engine_step_s(batch: int, args: argparse.Namespace, work: Path) -> float:
    """Seconds of one decode step of ``batch`` requests in the offline engine."""
    full = _latency(batch, args.input_len, args.output_len, args.iters, work)
    first = _latency(batch, args.input_len, 1, args.iters, work)
    return (full - first) / (args.output_len - 1)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(runtime: Path) -> dict[str, list[int]]:
    r = subprocess.run(
        [PKGD, "status", "--runtime-dir", str(runtime), "--json"], check=True, capture_output=True, text=True
    )
    out: dict[str, list[int]] = {}
    for c in json.loads(r.stdout)["status"]["children"]:
        out.setdefault(c["role"], []).append(int(c["pid"]))
    return out


def server_tpot(
    phases: list[tuple[int, bool]], args: argparse.Namespace, work: Path, overrides: tuple[str, ...] = ()
) -> dict[tuple[int, bool], dict[str, float]]:
    """One ``pkgd serve`` (with ``overrides``), each phase ``(streams, busy)`` in turn: median
    TPOT, output tokens/s and CPU ms per output token of the API servers and the engine core."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    runtime = work / f"run-{len(overrides)}"
    cmd = [PKGD, "serve", "--port", str(port), f"supervisor.runtime_dir={runtime}", *overrides]
    with open(work / f"serve-{len(overrides)}.log", "w") as log:
        env = {**os.environ, "PKGD_LOGGING__FORMAT": "json"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    rows: dict[tuple[int, bool], dict[str, float]] = {}
    try:
        _wait_ready(url, proc)
        urllib.request.urlopen(url + "/v1/models", timeout=10).read()
        pids = _children(runtime)
        for b, busy in phases:
            before = {role: sum(_cpu_s(p) for p in ps) for role, ps in pids.items()}
            out = work / f"serve-{len(overrides)}-{b}-{busy}.json"
            bench = [
                PKGD, "bench", "serve", "--base-url", url, "--num-prompts", str(max(b, 8)), "--max-concurrency", str(b),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--output-json", str(out),
            ]  # fmt: skip
            loop = _busy_loop() if busy else None
            try:
                subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
            finally:
                if loop is not None:
                    loop.kill()
                    loop.wait()
            fig = json.loads(out.read_text())
            tokens = fig["output_tokens"]
            cpu = {role: sum(_cpu_s(p) for p in ps) - before[role] for role, ps in pids.items()}
            rows[(b, busy)] = {
                "tpot_s": fig["tpot_s"]["median"],
                "tok_s": _tok_s(fig),
                "api_cpu_ms_per_token": 1000 * cpu.get("api-server", 0.0) / tokens,
                "engine_cpu_ms_per_token": 1000 * cpu.get("engine-core", 0.0) / tokens,
            }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,64", help="comma-separated batch sizes / concurrencies")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=3, help="timed iterations of each engine measurement")
    p.add_argument("--no-busy", action="store_true", help="skip the busy-loop phase")
    p.add_argument("--no-quantization", action="store_true", help="skip the model.quantization=none server")
    args = p.parse_args()
    batches = [int(b) for b in args.streams.split(",")]
    top = max(batches)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pkgd-overhead-") as tmp:
        work = Path(tmp)
        phases = [(b, False) for b in batches] + ([] if args.no_busy else [(top, True)])
        server = server_tpot(phases, args, work)
        engine = {b: engine_step_s(b, args, work) for b in batches}
        compare = not args.no_quantization and 1 in batches
        none = server_tpot([(1, False)], args, work, ("model.quantization=none",)) if compare else {}
        log = (work / "serve-0.log").read_text().splitlines()
        choice = next((json.loads(x) for x in log if x.startswith("{") and "quantization_choice" in x), {})
    print(f"{args.input_len} -> {args.output_len} tokens; {os.cpu_count()} CPUs; {time.monotonic() - started:.0f} s")
    print(f"{'streams':>7} {'engine ms/tok':>14} {'server TPOT ms':>15} {'server/engine':>14} "
          f"{'API CPU ms/tok':>15} {'engine CPU ms/tok':>18}")  # fmt: skip
    for b in batches:
        s, e = server[(b, False)], engine[b]
        if e <= 0:  # the two engine runs' difference drowned in noise: other load on the host
            print(f"{b:>7} engine step unmeasurable here (latency with {args.output_len} tokens <= with 1)")
            continue
        print(
            f"{b:>7} {1000 * e:>14.2f} {1000 * s['tpot_s']:>15.2f} {s['tpot_s'] / e:>14.2f} "
            f"{s['api_cpu_ms_per_token']:>15.3f} {s['engine_cpu_ms_per_token']:>18.3f}"
        )
    if not args.no_busy:
        quiet, busy = server[(top, False)]["tok_s"], server[(top, True)]["tok_s"]
        print(f"{top} streams with a busy loop on one core: {busy:.1f} / {quiet:.1f} tok/s = {busy / quiet:.2f}")
    if none:
        default, dense = 1 / server[(1, False)]["tpot_s"], 1 / none[(1, False)]["tpot_s"]
        print(
            f"single stream through the server, default model.quantization vs none: {default:.1f} / {dense:.1f} "
            f"tok/s = {default / dense:.2f} (default: {choice.get('reason', 'see serve log')})"
        )


if __name__ == "__main__":
    main()
