"""What the server path adds per token: server TPOT against the engine's own decode step time,
at 1 and at 64 streams, in one run on the default model.

Engine: ``pkgd bench latency`` (the offline engine, no server) on a batch of B prompts, once
with ``--output-len O`` and once with 1; their difference over O - 1 is one decode step of a
batch of B, the engine's time per output token of each request. Server: ``pkgd serve`` with
``pkgd bench serve`` keeping B requests in flight (at least 8 requests in all, same lengths); its
median TPOT is the time per output token a client sees, engine step → output IPC →
detokenizer → SSE frame → socket. The ratio server / engine is the server path's cost (1.00 =
free). Also printed: the API servers' and the engine core's CPU seconds per output token
during the server phase (the API process competes with the engine for the same cores).

    python benchmarks/server_overhead.py                 # B = 1 and 64, 32 -> 128 tokens
    python benchmarks/server_overhead.py --streams 1,16 --output-len 64
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

from contention import _free_port, _wait_ready  # noqa: E402


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


def server_tpot(batches: list[int], args: argparse.Namespace, work: Path) -> dict[int, dict[str, float]]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    runtime = work / "run"
    cmd = [PKGD, "serve", "--port", str(port), f"supervisor.runtime_dir={runtime}"]
    with open(work / "serve.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    rows: dict[int, dict[str, float]] = {}
    try:
        _wait_ready(url, proc)
        urllib.request.urlopen(url + "/v1/models", timeout=10).read()
        pids = _children(runtime)
        for b in batches:
            before = {role: sum(_cpu_s(p) for p in ps) for role, ps in pids.items()}
            out = work / f"serve-{b}.json"
            bench = [
                PKGD, "bench", "serve", "--base-url", url, "--num-prompts", str(max(b, 8)), "--max-concurrency", str(b),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--output-json", str(out),
            ]  # fmt: skip
            subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
            fig = json.loads(out.read_text())
            tokens = fig["output_tokens"]
            cpu = {role: sum(_cpu_s(p) for p in ps) - before[role] for role, ps in pids.items()}
            rows[b] = {
                "tpot_s": fig["tpot_s"]["median"],
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
    args = p.parse_args()
    batches = [int(b) for b in args.streams.split(",")]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pkgd-overhead-") as tmp:
        work = Path(tmp)
        server = server_tpot(batches, args, work)
        engine = {b: engine_step_s(b, args, work) for b in batches}
    print(f"{args.input_len} -> {args.output_len} tokens; {time.monotonic() - started:.0f} s")
    print(f"{'streams':>7} {'engine ms/tok':>14} {'server TPOT ms':>15} {'server/engine':>14} "
          f"{'API CPU ms/tok':>15} {'engine CPU ms/tok':>18}")  # fmt: skip
    for b in batches:
        s, e = server[b], engine[b]
        if e <= 0:  # the two engine runs' difference drowned in noise: other load on the host
            print(f"{b:>7} engine step unmeasurable here (latency with {args.output_len} tokens <= with 1)")
            continue
        print(
            f"{b:>7} {1000 * e:>14.2f} {1000 * s['tpot_s']:>15.2f} {s['tpot_s'] / e:>14.2f} "
            f"{s['api_cpu_ms_per_token']:>15.3f} {s['engine_cpu_ms_per_token']:>18.3f}"
        )


if __name__ == "__main__":
    main()
