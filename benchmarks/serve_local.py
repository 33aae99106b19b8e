"""Start an engine core and API server(s) as real processes (as the supervisor does), then run
`pkgd bench serve` against them and print its figures, plus the peak RSS (VmHWM) of each
child.

    python benchmarks/serve_local.py [--api-servers N] [--config KEY=VALUE ...] -- [bench serve args]

Examples (the figures in the api report):
    python benchmarks/serve_local.py --fake-engine -- --no-stream --input-len 8 --output-len 1 \\
        --num-prompts 2000 --max-concurrency 32
    python benchmarks/serve_local.py -- --no-stream --input-len 8 --output-len 1 --num-prompts 1000 --max-concurrency 32
    python benchmarks/serve_local.py -- --input-len 128 --output-len 128 --num-prompts 128 --max-concurrency 64

Once the supervisor is merged, ``pkgd`` + ``pkgd bench serve --base-url ...`` does the same.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from ipc.launch import listen_socket, spawn_api_server, spawn_engine, write_config  # noqa: E402

from pkgd.cli import bench_serve  # noqa: E402
from pkgd.config.vllm_config import VllmConfig  # noqa: E402
from pkgd.ipc import transport  # noqa: E402


def _nested(items: list[str]) -> dict:
    out: dict = {}
    for item in items:
        key, _, value = item.partition("=")
        d = out
        *parents, leaf = key.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = yaml.safe_load(value)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    argv = sys.argv[1:]
    ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser()
    p.add_argument("--api-servers", type=int, default=1)
    p.add_argument("--config", nargs="*", default=[], help="dotted KEY=VALUE config overrides")
    p.add_argument(
        "--fake-engine",
        action="store_true",
        help="serve tests/ipc/fake_engine.py (no model compute): measures the frontend alone",
    )
    args = p.parse_args(ours)
    bp = argparse.ArgumentParser()
    bench_serve.add_serve_args(bp)
    bargs = bp.parse_args(rest)

    tmp = Path(tempfile.mkdtemp(prefix="pkgd-bench-"))
    config = VllmConfig.model_validate(_nested(args.config))
    cfg = write_config(tmp, config)
    address = transport.ipc_address(tmp, 0)
    t0 = time.monotonic()
    fake_env = {"FAKE_VOCAB": "49152", "FAKE_MAX_MODEL_LEN": "8192"}
    engine = spawn_engine(cfg, address, fake=args.fake_engine, env=fake_env if args.fake_engine else None)
    engine.wait_ready(900)
    sock = listen_socket()
    apis = [spawn_api_server(cfg, sock, [address], index=i) for i in range(args.api_servers)]
    for a in apis:
        a.wait_ready(120)
    print(f"started engine + {args.api_servers} API server(s) in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    bargs.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        cpu0 = {a.proc.pid: cpu_seconds(a.proc.pid) for a in apis}
        engine_cpu0 = cpu_seconds(engine.proc.pid)
        fig = asyncio.run(bench_serve.run_load(bargs))
        bench_serve.print_report(fig)
        api_cpu = sum(cpu_seconds(pid) - c for pid, c in cpu0.items())
        n = fig["num_prompts"] + bargs.warmup
        print(
            f"CPU during the run: API server(s) {api_cpu:.1f} s = {1e3 * api_cpu / n:.2f} ms per request "
            f"(~{n / api_cpu:.0f} requests/s per core), engine {cpu_seconds(engine.proc.pid) - engine_cpu0:.1f} s, "
            f"wall {fig['elapsed_s']:.1f} s"
        )
        rss = {"engine": vm_hwm(engine.proc.pid), **{f"api{i}": vm_hwm(a.proc.pid) for i, a in enumerate(apis)}}
        print(
            "Peak RSS (VmHWM): "
            + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in rss.items())
            + f"; sum {sum(rss.values()) / 1e6:.0f} MB"
        )
    finally:
        for a in apis:
            a.stop()
        engine.stop()
    return 1 if fig["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
