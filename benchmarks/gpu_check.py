"""The checks of ``benchmarks/gpu_check.sh`` (which sets up the venv and runs this in it).

Each step runs as a subprocess of the venv's interpreter, its output kept under ``--work``; a
failed step is reported and the others still run. Prints one summary, writes summary.json, and
exits 1 when any step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks" / "peers"))

from servers import Server, free_port  # noqa: E402

PY = sys.executable
PKGD = str(Path(PY).parent / "pkgd")


def step(
    name: str, argv: list[str], work: Path, env: dict[str, str] | None = None, timeout: float = 3600
) -> tuple[bool, str]:
    """Run ``argv``; returns (ok, combined output); the output also goes to ``work/<name>.log``."""
    print(f"gpu_check: {name}: {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            argv, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=REPO
        )
        out, ok = r.stdout + r.stderr, r.returncode == 0
    except subprocess.TimeoutExpired as e:
        out, ok = f"{e}\n{e.stdout or ''}{e.stderr or ''}", False
    (work / f"{name}.log").write_text(out)
    print(f"gpu_check: {name}: {'ok' if ok else 'FAILED'} in {time.monotonic() - t0:.0f} s", flush=True)
    return ok, out


def junit_counts(path: Path) -> dict[str, int]:
    """tests / failures / errors / skipped of a pytest --junitxml report."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} if suite is not None else {}


def pytest_step(name: str, paths: list[str], work: Path, env: dict[str, str] | None = None) -> dict:
    xml = work / f"{name}.xml"
    ok, _ = step(name, [PY, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"], work, env)
    counts = junit_counts(xml)
    return {"ok": ok and counts.get("tests", 0) > 0, **counts}


def serve_64(work: Path, streams: int, prompts: int) -> dict:
    port = free_port()
    with Server("pkgd", [PKGD, "serve", "--port", str(port)], port, work / "serve-server.log") as server:
        cold = server.start(timeout=900)
        out = work / "serve.json"
        ok, _ = step(
            "bench_serve",
            [
                PKGD,
                "bench",
                "serve",
                "--base-url",
                server.base_url,
                "--num-prompts",
                str(prompts),
                "--max-concurrency",
                str(streams),
                "--output-json",
                str(out),
            ],
            work,
        )
        fig = json.loads(out.read_text()) if out.exists() else {}
        return {
            "ok": ok and not fig.get("failed", 1),
            "cold_start_s": cold,
            "peak_rss_gb": server.sampler.peak_rss / 1e9,
            "output_tok_s": fig.get("output_tokens_per_s"),
            "ttft_median_s": fig.get("ttft_s", {}).get("median"),
            "ttft_p99_s": fig.get("ttft_s", {}).get("p99"),
            "tpot_median_ms": (fig.get("tpot_s", {}).get("median") or 0) * 1e3,
        }


def main() -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_check.py")
    ap.add_argument("--work", type=Path, default=REPO / "benchmarks" / ".gpu")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--serve-prompts", type=int, default=256)
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    import torch

    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}
    res["kernel_tests"] = pytest_step("kernel_tests", ["tests/kernels"], work, {"PKGD_KERNEL_TEST_DEVICE": "cuda"})
    ok, out = step("kernel_bench", [PY, "-m", "pkgd_kernels.bench"], work)
    res["kernel_bench"] = {"ok": ok, "report": out.strip().splitlines()[-20:]}
    parity = pytest_step("parity", ["tests/runner/test_device_parity.py"], work)
    parity["ok"] = parity["ok"] and parity.get("skipped", 1) == 0  # skipped = not run on the GPU
    res["parity_fp16_bf16"] = parity
    out_json = work / "throughput.json"
    ok, _ = step(
        "bench_throughput",
        [
            PKGD,
            "bench",
            "throughput",
            "--num-prompts",
            "256",
            "--input-len",
            "128",
            "--output-len",
            "128",
            "--ignore-eos",
            "--output-json",
            str(out_json),
        ],
        work,
    )
    fig = json.loads(out_json.read_text()) if out_json.exists() else {}
    res["throughput"] = {
        "ok": ok,
        "output_tok_s": _find(fig, "output_tokens_per_s"),
        "single_stream_decode_tok_s": _find(fig, "decode_tokens_per_s"),
    }
    try:
        res["serve"] = serve_64(work, args.streams, args.serve_prompts)
    except (RuntimeError, OSError) as e:
        res["serve"] = {"ok": False, "error": str(e)}
    (work / "summary.json").write_text(json.dumps(res, indent=2))
    print_summary(res, work)
    return 0 if all(v.get("ok") for v in res.values() if isinstance(v, dict)) else 1


def _find(fig: dict, key: str):
    if key in fig:
        return fig[key]
    for v in fig.values():
        if isinstance(v, dict) and (found := _find(v, key)) is not None:
            return found
    return None


def print_summary(res: dict, work: Path) -> None:
    def mark(d: dict) -> str:
        return "ok    " if d.get("ok") else "FAILED"

    k, p, t, s = res["kernel_tests"], res["parity_fp16_bf16"], res["throughput"], res["serve"]
    print(f"\n== gpu_check summary: {res['gpu']}, torch {res['torch']} (CUDA {res['cuda']})")
    print(
        f"{mark(k)} kernel tests on the GPU: {k.get('tests', 0)} run, {k.get('failures', 0)} failed, "
        f"{k.get('errors', 0)} errors, {k.get('skipped', 0)} skipped"
    )
    print(f"{mark(res['kernel_bench'])} kernel benchmark (Triton vs reference): see {work / 'kernel_bench.log'}")
    print(
        f"{mark(p)} engine parity in float16/bfloat16: {p.get('tests', 0)} run, {p.get('failures', 0)} failed, "
        f"{p.get('skipped', 0)} skipped"
    )
    print(
        f"{mark(t)} pkgd bench throughput 256 x 128->128: {t.get('output_tok_s') or 0:.1f} output tok/s; "
        f"single stream {t.get('single_stream_decode_tok_s') or 0:.1f} tok/s"
    )
    if "error" in s:
        print(f"FAILED serving: {s['error']}")
    else:
        print(
            f"{mark(s)} serving {s.get('output_tok_s') or 0:.1f} output tok/s at 64 streams; TTFT median "
            f"{s.get('ttft_median_s') or 0:.2f} s, p99 {s.get('ttft_p99_s') or 0:.2f} s; TPOT median "
            f"{s.get('tpot_median_ms') or 0:.1f} ms; cold start {s.get('cold_start_s') or 0:.1f} s; "
            f"peak RSS {s.get('peak_rss_gb') or 0:.2f} GB"
        )
    print(f"(logs and summary.json in {work})")


if __name__ == "__main__":
    sys.exit(main())
