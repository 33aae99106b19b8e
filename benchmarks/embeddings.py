"""Embeddings throughput: ``/v1/embeddings`` of a pooling server vs transformers' forward pass.

Both embed the same ``--inputs`` random token-id prompts of ``--tokens`` tokens each, in the
same run:

* pkgd: ``pkgd serve --runner pooling`` (the embedded SmolLM2-135M-Instruct, or ``--model``)
  on 127.0.0.1:``--port``; the inputs go as ``--concurrency`` concurrent requests of
  ``--per-request`` inputs each (token ids, base64 vectors), so the engine batches them
  continuously. Timed from the first request sent to the last answer read (HTTP, JSON and
  base64 included).
* transformers: ``AutoModel`` on the same converted safetensors directory, float32, in static
  batches of ``--hf-batch`` (no padding: every prompt has the same length), last-token
  pooling and L2 normalisation, with as many torch threads as the engine uses (the cores
  left after one for the API server, as pkgd chooses by default).

Each side runs once as a warm-up first. Printed: embeddings/s of each, their ratio, and the
largest difference between the two sides' vectors (a parity check, not a speed figure).

    .venv/bin/python benchmarks/embeddings.py [--inputs 256] [--tokens 128] [--port 18511]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model.source (default: the embedded SmolLM2)")
    p.add_argument("--inputs", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--per-request", type=int, default=16, help="inputs per /v1/embeddings request")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--hf-batch", type=int, default=32, help="transformers' static batch size")
    p.add_argument("--port", type=int, default=18511)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def start_server(args: argparse.Namespace, log: Path) -> subprocess.Popen:
    # Its own runtime directory: another daemon on this host keeps its control socket.
    cmd = [
        str(ROOT / ".venv" / "bin" / "pkgd"),
        "serve",
        "--runner",
        "pooling",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--max-model-len",
        str(max(512, args.tokens + 16)),
        f"supervisor.runtime_dir={log.parent / 'run'}",
    ]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise SystemExit(f"pkgd serve exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"pkgd serve not ready in 900 s:\n{log.read_text(errors='replace')[-2000:]}")


async def embed_via_server(
    url: str, prompts: list[list[int]], per_request: int, concurrency: int
) -> tuple[np.ndarray, float]:
    chunks = [prompts[i : i + per_request] for i in range(0, len(prompts), per_request)]
    sem = asyncio.Semaphore(concurrency)
    out: list[np.ndarray | None] = [None] * len(chunks)

    async def one(http: httpx.AsyncClient, i: int) -> None:
        async with sem:
            r = await http.post("/v1/embeddings", json={"input": chunks[i], "encoding_format": "base64"})
            r.raise_for_status()
            out[i] = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]])

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(http, i) for i in range(len(chunks))))
        seconds = time.perf_counter() - t0
    return np.concatenate(out), seconds  # type: ignore[arg-type]


def embed_with_transformers(model_dir: Path, prompts: list[list[int]], batch: int) -> tuple[np.ndarray, float]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model(ids[:batch])  # warm-up
        t0 = time.perf_counter()
        vecs = [
            F.normalize(model(ids[i : i + batch]).last_hidden_state[:, -1], dim=-1) for i in range(0, len(ids), batch)
        ]
        seconds = time.perf_counter() - t0
    return torch.cat(vecs).numpy(), seconds


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(100, 49152, size=(args.inputs, args.tokens)).tolist()
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(args, Path(tmp) / "serve.log")
        try:
            asyncio.run(
                embed_via_server(url, prompts[: args.per_request * 2], args.per_request, args.concurrency)
            )  # warm-up
            ours, t_ours = asyncio.run(embed_via_server(url, prompts, args.per_request, args.concurrency))
        finally:
            server.terminate()
            server.wait(60)

    import torch

    from pkgd.config.vllm_config import VllmConfig
    from pkgd.engine.core import default_cpu_threads
    from pkgd.model_files.resolve import ensure_float_weights, resolve_model

    cfg = VllmConfig.model_validate({"model": {"source": args.model} if args.model else {}})
    threads = default_cpu_threads(cfg)
    torch.set_num_threads(threads)
    files = resolve_model(cfg.model)
    ensure_float_weights(files)  # transformers reads the dequantized safetensors
    theirs, t_hf = embed_with_transformers(files.model_dir, prompts, args.hf_batch)
    n = len(prompts)
    print(
        f"inputs: {n} x {args.tokens} tokens; pkgd: {args.concurrency} concurrent requests of {args.per_request}; "
        f"transformers: static batches of {args.hf_batch}, {threads} torch thread(s); host cores: {os.cpu_count()}"
    )
    print(f"pkgd server   : {n / t_ours:8.1f} embeddings/s ({t_ours:.2f} s)")
    print(f"transformers  : {n / t_hf:8.1f} embeddings/s ({t_hf:.2f} s)")
    print(f"ratio pkgd / transformers: {t_hf / t_ours:.2f}x")
    print(f"parity: max |pkgd - transformers| over all vectors = {np.abs(ours - theirs).max():.2e}")


if __name__ == "__main__":
    sys.exit(main())
