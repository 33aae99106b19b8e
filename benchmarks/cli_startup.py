"""Wall time of `pkgd --help` and `pkgd config validate` (target: under 0.5 s each, no torch).

Each command runs as a fresh process through the installed console script, several times;
the median, min and max are printed, beside a bare ``python -c pass`` measured in the same
run as the baseline (timings on a shared machine are noisy: compare the ratio too). A run
also reports whether the command imported torch (it must not).

    .venv/bin/python benchmarks/cli_startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = "import sys, runpy; sys.argv = ['pkgd', *sys.argv[1:]]; import atexit; " \
        "atexit.register(lambda: sys.stderr.write('\\nTORCH=%s\\n' % ('torch' in sys.modules)))\n" \
        "from pkgd.cli.main import main; sys.exit(main())"


def _time(cmd: list[str], runs: int, env: dict[str, str]) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        times.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}")
    return times


def _imports_torch(args: list[str], env: dict[str, str]) -> bool:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True)
    return "TORCH=True" in proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    opts = parser.parse_args()
    pkgd = str(Path(sys.executable).parent / "pkgd")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PKGD_")}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        (tree / "conf.d").mkdir()
        (tree / "pkgd.yaml").write_text("defaults:\n  - model: qwen\nfrontend: {port: 9000}\n")
        (tree / "conf.d" / "10-tp.yaml").write_text("parallel: {tp: 2}\n")
        cases = {
            "python -c pass (baseline)": ([sys.executable, "-c", "pass"], None),
            "pkgd --help": ([pkgd, "--help"], ["--help"]),
            "pkgd config validate DIR": ([pkgd, "config", "validate", str(tree)], ["config", "validate", str(tree)]),
        }
        print(f"{'command':32} {'median s':>9} {'min s':>7} {'max s':>7} {'x baseline':>10}  torch")
        baseline = None
        for name, (cmd, args) in cases.items():
            _time(cmd, 1, env)  # warm the file cache
            times = _time(cmd, opts.runs, env)
            median = statistics.median(times)
            baseline = baseline or median
            torch = "-" if args is None else ("IMPORTED" if _imports_torch(args, env) else "no")
            print(f"{name:32} {median:9.3f} {min(times):7.3f} {max(times):7.3f} {median / baseline:10.1f}  {torch}")
    print(f"target: each pkgd command under 0.500 s median ({opts.runs} runs)")


if __name__ == "__main__":
    main()
