"""Serving throughput while another process takes one core, against the same server quiet.

For each mode (``adaptive``: ``parallel.cpu_threads_adaptive=true``, the default; ``fixed``:
false) this starts ``pkgd serve`` on the default model, runs ``pkgd bench serve`` (the light
client) quiet, then again with a busy loop (``while True: pass``) pinned to the last core this
process may use, and prints output tokens/s of each phase and their ratio (busy / quiet), plus
the engine's ``cpu_threads_changed`` log lines. Every ratio compares two phases of one run.

    python benchmarks/contention.py                      # both modes, 32 streams of 64 -> 64
    python benchmarks/contention.py --modes adaptive --streams 64 --output-len 128

The ``fixed`` busy phase is the slow one (a 2-thread engine waits at every OpenMP barrier for
the thread that shares the busy core): it can take minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PKGD = str(Path(sys.executable).with_name("pkgd"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"pkgd serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("pkgd serve did not become ready")


def _busy_loop() -> subprocess.Popen:
    core = max(os.sched_getaffinity(0))
    return subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"],
        stdout=subprocess.DEVNULL,
    )


def _bench(url: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        PKGD, "bench", "serve", "--base-url", url, "--num-prompts", str(args.prompts or args.streams),
        "--max-concurrency", str(args.streams), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--output-json", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def _tok_s(figures: dict) -> float:
    for key in ("output_throughput", "output_tokens_per_s", "output_tok_s"):
        if key in figures:
            return float(figures[key])
    raise SystemExit(f"no output throughput in {sorted(figures)}")


def run_mode(mode: str, args: argparse.Namespace, work: Path) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / f"{mode}.log"
    env = {**os.environ, "PKGD_LOGGING__FORMAT": "json"}
    cmd = [PKGD, "serve", "--port", str(port), f"parallel.cpu_threads_adaptive={str(mode == 'adaptive').lower()}"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(url, proc)
        quiet = _tok_s(_bench(url, args, work / f"{mode}-quiet.json"))
        busy_proc = _busy_loop()
        try:
            busy = _tok_s(_bench(url, args, work / f"{mode}-busy.json"))
        finally:
            busy_proc.kill()
            busy_proc.wait()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    changes = [json.loads(line) for line in log.read_text().splitlines() if "cpu_threads_changed" in line]
    return {"mode": mode, "quiet": quiet, "busy": busy, "changes": changes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="adaptive,fixed", help="comma-separated: adaptive, fixed")
    p.add_argument("--streams", type=int, default=32, help="requests in flight")
    p.add_argument("--prompts", type=int, default=0, help="requests per phase (default: --streams)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pkgd-contention-") as tmp:
        rows = [run_mode(m, args, Path(tmp)) for m in args.modes.split(",")]
    print(f"{args.streams} streams, {args.input_len} -> {args.output_len} tokens, {os.cpu_count()} CPUs")
    print(f"{'mode':<10} {'quiet tok/s':>12} {'busy tok/s':>11} {'busy/quiet':>11}  thread changes")
    for r in rows:
        moves = ", ".join(f"{c.get('previous')}->{c.get('threads')}" for c in r["changes"]) or "none"
        print(f"{r['mode']:<10} {r['quiet']:>12.1f} {r['busy']:>11.1f} {r['busy'] / r['quiet']:>11.2f}  {moves}")


if __name__ == "__main__":
    main()
