"""Wall time of `pkgd --help`, `pkgd config validate` and a cold start to ``ready``, now and
(``--before REV``) at an earlier commit, in the same run.

Each command runs as a fresh process several times; the median, min and max are printed beside
a bare ``python -c pass`` measured in the same run (timings on a shared machine are noisy:
compare the ratios). ``--before REV`` checks REV out into a temporary git worktree and runs the
same commands with that tree's packages first on ``PYTHONPATH``, alternating now/before run by
run, and prints now / before. A run also reports whether the command imported torch (it must
not). ``--cold-start N`` adds N cold starts of the daemon on the embedded model: seconds from
the process start to ``GET /v1/models`` answering 200 (the converted weights are cached by the
first, unmeasured, start of each tree).

    .venv/bin/python benchmarks/cli_startup.py [--runs 15] [--before e4fc99d] [--cold-start 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY = "import sys; from pkgd.cli.main import main; sys.exit(main())"
PROBE = (
    "import sys, atexit; atexit.register(lambda: sys.stderr.write('\\nTORCH=%s\\n' % ('torch' in sys.modules)))\n"
    + ENTRY
)


def _run(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return elapsed


def _imports_torch(args: list[str], env: dict[str, str]) -> bool:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True)
    return "TORCH=True" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cold_start(env: dict[str, str], workdir: Path, timeout: float = 300.0) -> float:
    """Seconds from spawning ``pkgd serve`` to its first 200 on /v1/models; then SIGTERM."""
    port = _free_port()
    args = ["serve", "--port", str(port), f"supervisor.runtime_dir={workdir / 'run'}"]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", ENTRY, *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise SystemExit(f"pkgd serve exited {proc.returncode} before ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
        raise SystemExit(f"pkgd serve not ready in {timeout:.0f} s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _before_tree(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(into), rev], check=True)
    return into


def _env_for(tree: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PKGD_")}
    if tree is not None:  # that tree's packages ahead of the installed (editable) ones
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "daemon"), str(tree / "kernels")])
    return env


def _row(name: str, times: list[float], baseline: float, torch: str) -> str:
    median = statistics.median(times)
    return f"{name:40} {median:9.3f} {min(times):7.3f} {max(times):7.3f} {median / baseline:10.1f}  {torch}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--before", metavar="REV", help="also time the commands at this commit")
    parser.add_argument("--cold-start", type=int, default=0, metavar="N", help="cold starts to ready per tree")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        trees: dict[str, dict[str, str]] = {"now": _env_for(None)}
        if opts.before:
            trees["before"] = _env_for(_before_tree(opts.before, tmpdir / "before"))
        try:
            _measure(opts, tmpdir, trees)
        finally:
            if opts.before:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmpdir / "before")])


def _measure(opts: argparse.Namespace, tmpdir: Path, trees: dict[str, dict[str, str]]) -> None:
    tree = tmpdir / "etc"
    (tree / "conf.d").mkdir(parents=True)
    (tree / "pkgd.yaml").write_text("defaults:\n  - model: qwen\nfrontend: {port: 9000}\n")
    (tree / "conf.d" / "10-tp.yaml").write_text("parallel: {tp: 2}\n")
    commands = {"pkgd --help": ["--help"], "pkgd config validate DIR": ["config", "validate", str(tree)]}
    baseline_cmd = [sys.executable, "-c", "pass"]
    _run(baseline_cmd, trees["now"])
    times: dict[str, list[float]] = {"python -c pass (baseline)": []}
    for _ in range(opts.runs):
        times["python -c pass (baseline)"].append(_run(baseline_cmd, trees["now"]))
    for name, args in commands.items():
        for label, env in trees.items():
            _run([sys.executable, "-c", ENTRY, *args], env)  # warm the file cache
        for _ in range(opts.runs):
            for label, env in trees.items():
                times.setdefault(f"{name} [{label}]", []).append(_run([sys.executable, "-c", ENTRY, *args], env))
    for label, env in trees.items() if opts.cold_start else ():
        _cold_start(env, tmpdir / f"warm-{label}")  # converts and caches the weights, builds kernels
    for i in range(opts.cold_start):
        for label, env in trees.items():
            times.setdefault(f"cold start to ready [{label}]", []).append(
                _cold_start(env, tmpdir / f"cold-{label}-{i}")
            )
    baseline = statistics.median(times["python -c pass (baseline)"])
    print(f"{'command':40} {'median s':>9} {'min s':>7} {'max s':>7} {'x baseline':>10}  torch")
    for name, ts in times.items():
        label = name.rsplit("[", 1)[-1].rstrip("]") if "[" in name else None
        args = next((a for n, a in commands.items() if name.startswith(n)), None)
        torch = "-" if args is None or label is None else ("IMPORTED" if _imports_torch(args, trees[label]) else "no")
        print(_row(name, ts, baseline, torch))
    if "before" in trees:
        print("\nnow / before (median ratio; < 1 is faster now):")
        for name in [*commands, *(["cold start to ready"] if opts.cold_start else [])]:
            now, before = times[f"{name} [now]"], times[f"{name} [before]"]
            print(f"  {name:38} {statistics.median(now) / statistics.median(before):6.3f}")
    print(f"target: each pkgd command under 0.500 s median ({opts.runs} runs)")


if __name__ == "__main__":
    main()
