"""Rerank throughput: ``/v1/rerank`` of a cross-encoder server vs transformers' forward pass.

The model is the embedded SmolLM2-135M-Instruct (or ``--model``) served as an LLM reranker by
vLLM's ``--hf-overrides`` recipe (``classifier_from_token: [no, yes]``,
``is_original_qwen3_reranker``): a document's score is P(yes) of the yes/no softmax of the causal
LM's last logits. Both sides score the same ``--queries`` queries against ``--docs`` documents
each (random sentences of ``--words`` words), in the same run:

* pkgd: ``pkgd serve`` on 127.0.0.1:``--port``, one rerank request per query, ``--concurrency``
  in flight, so the engine batches pairs across requests. Timed from the first request sent
  to the last answer read (HTTP and JSON included).
* transformers: ``AutoModelForCausalLM`` on the same safetensors, float32, the pairs tokenized
  as the server does (``tokenizer(query, document)``), right-padded in static batches of
  ``--hf-batch`` with an attention mask, each pair read at its last real token; as many torch
  threads as the engine uses.

Each side runs once as a warm-up first. Printed: pairs/s of each, their ratio, and the largest
difference between the two sides' scores (a parity check, not a speed figure).

    .venv/bin/python benchmarks/rerank.py [--queries 16] [--docs 32] [--words 40] [--port 18512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

WORDS = (
    "the a river city model paper light engine market garden music winter data signal bridge "
    "forest history language network ocean planet theory voice window energy science table "
    "paris france capital museum train school doctor result number pattern story question"
).split()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model.source (default: the embedded SmolLM2)")
    p.add_argument("--architecture", default="LlamaForSequenceClassification")
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--docs", type=int, default=32, help="documents per query")
    p.add_argument("--words", type=int, default=40, help="words per document")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--port", type=int, default=18512)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def start_server(args: argparse.Namespace, log: Path) -> subprocess.Popen:
    overrides = {
        "architectures": [args.architecture],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }
    # Its own runtime directory: another daemon on this host keeps its control socket.
    cmd = [
        sys.executable,
        "-m",
        "pkgd.cli.main",
        "serve",
        "--hf-overrides",
        json.dumps(overrides),
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--max-model-len",
        "1024",
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


async def rerank_via_server(
    url: str, queries: list[str], docs: list[list[str]], concurrency: int
) -> tuple[np.ndarray, float]:
    sem = asyncio.Semaphore(concurrency)
    out = np.zeros((len(queries), len(docs[0])), dtype=np.float64)

    async def one(http: httpx.AsyncClient, i: int) -> None:
        async with sem:
            r = await http.post(
                "/v1/rerank", json={"query": queries[i], "documents": docs[i], "return_documents": False}
            )
            r.raise_for_status()
            for item in r.json()["results"]:
                out[i, item["index"]] = item["relevance_score"]

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(http, i) for i in range(len(queries))))
        seconds = time.perf_counter() - t0
    return out, seconds


def rerank_with_transformers(
    model_dir: Path, tok_dir: Path, queries: list[str], docs: list[list[str]], batch: int
) -> tuple[np.ndarray, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pairs = [tok(q, d)["input_ids"] for q, ds in zip(queries, docs) for d in ds]

    def run(rows: list[list[int]]) -> torch.Tensor:
        n = max(map(len, rows))
        ids = torch.tensor([r + [0] * (n - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows])
        logits = model(input_ids=ids, attention_mask=mask).logits
        last = logits[torch.arange(len(rows)), torch.tensor([len(r) - 1 for r in rows])]
        return torch.softmax(last[:, [no, yes]], dim=-1)[:, 1]

    with torch.inference_mode():
        run(pairs[:batch])  # warm-up
        t0 = time.perf_counter()
        scores = torch.cat([run(pairs[i : i + batch]) for i in range(0, len(pairs), batch)])
        seconds = time.perf_counter() - t0
    return scores.double().numpy().reshape(len(queries), len(docs[0])), seconds


def main() -> None:
    args = parse_args()
    rng = np.random.default_rng(args.seed)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(WORDS, size=n))

    queries = [sentence(8) + "?" for _ in range(args.queries)]
    docs = [[sentence(args.words) + "." for _ in range(args.docs)] for _ in range(args.queries)]
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(args, Path(tmp) / "serve.log")
        try:
            asyncio.run(rerank_via_server(url, queries[:2], docs[:2], args.concurrency))  # warm-up
            ours, t_ours = asyncio.run(rerank_via_server(url, queries, docs, args.concurrency))
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
    theirs, t_hf = rerank_with_transformers(files.model_dir, files.tokenizer_dir, queries, docs, args.hf_batch)
    n = args.queries * args.docs
    print(
        f"pairs: {args.queries} queries x {args.docs} documents of {args.words} words; pkgd: {args.concurrency} "
        f"concurrent rerank requests; transformers: padded batches of {args.hf_batch}, {threads} torch thread(s); "
        f"host cores: {os.cpu_count()}"
    )
    print(f"pkgd server   : {n / t_ours:8.1f} pairs/s ({t_ours:.2f} s)")
    print(f"transformers  : {n / t_hf:8.1f} pairs/s ({t_hf:.2f} s)")
    print(f"ratio pkgd / transformers: {t_hf / t_ours:.2f}x")
    print(f"parity: max |pkgd - transformers| over all scores = {np.abs(ours - theirs).max():.2e}")


if __name__ == "__main__":
    sys.exit(main())
