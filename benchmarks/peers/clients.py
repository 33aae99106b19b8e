"""The two load generators every server is measured with, and the prompts' seeds.

- ``light``: ``pkgd bench serve`` (pkgd's venv): one asyncio process on httpx, little CPU.
- ``vllm``: ``vllm bench serve`` (the vLLM venv the harness installs): vLLM's own client, which
  tokenizes and detokenizes on the client side and takes several times the light client's CPU,
  so on a small box the same server measures lower with it; both are reported.

Both send ``--num-prompts`` completion requests of exactly ``input_len`` random prompt tokens,
``ignore_eos``, ``output_len`` tokens each, streaming, at most ``concurrency`` in flight, and
both read back output tokens/s, median and p99 TTFT and median TPOT (`Figures`).

Seeds: a server keeps a prefix cache for its whole life, so a prompt sent again at another
concurrency level, by the other client or in the contention phase would be answered from the
cache and flatter that level. `level_seed` gives every (phase, client, concurrency) of one
server's life its own seed, hence its own random prompts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

CLIENTS = ("light", "vllm")
PHASES = ("serve", "quiet", "busy")
"""serve: the 1- and 64-stream levels; quiet / busy: the contention phase without and with a
busy loop on one core (same shape, its own prompts)."""


def level_seed(phase: str, client: str, concurrency: int, base: int = 0) -> int:
    """The prompt seed of one load level: distinct for every phase x client x concurrency (for
    concurrency below 10,000), the same across servers so each server gets the same prompts
    at the same level. Raises `ValueError` for an unknown phase or client."""
    if phase not in PHASES or client not in CLIENTS:
        raise ValueError(f"unknown phase {phase!r} or client {client!r}")
    return base + 1_000_000 * (1 + PHASES.index(phase)) + 10_000 * CLIENTS.index(client) + concurrency


@dataclasses.dataclass(frozen=True)
class Figures:
    """One load level as measured by one client."""

    tok_s: float  # output tokens/s over the level
    ttft_med_s: float
    ttft_p99_s: float
    tpot_med_ms: float
    failed: int
    errors: str = ""


@dataclasses.dataclass(frozen=True)
class Level:
    """One load level to send: ``num_prompts`` requests of ``input_len`` -> ``output_len``
    tokens, at most ``concurrency`` at a time, prompts from ``seed``."""

    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    seed: int


def light_argv(pkgd: Path, base_url: str, level: Level, out_json: Path) -> list[str]:
    return [
        str(pkgd),
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--num-prompts",
        str(level.num_prompts),
        "--max-concurrency",
        str(level.concurrency),
        "--input-len",
        str(level.input_len),
        "--output-len",
        str(level.output_len),
        "--random-seed",
        str(level.seed),
        "--output-json",
        str(out_json),
    ]


def parse_light(fig: dict) -> Figures:
    """`Figures` from ``pkgd bench serve --output-json``'s object."""
    return Figures(
        tok_s=fig["output_tokens_per_s"],
        ttft_med_s=fig["ttft_s"]["median"],
        ttft_p99_s=fig["ttft_s"]["p99"],
        tpot_med_ms=fig["tpot_s"]["median"] * 1e3,
        failed=int(fig.get("failed") or 0),
        errors=str(fig.get("errors") or ""),
    )


def vllm_argv(vllm: Path, base_url: str, model: str, tokenizer: Path, level: Level, out_json: Path) -> list[str]:
    """``vllm bench serve`` against ``base_url`` with its random dataset of exact lengths
    (``--random-range-ratio 0``), the server's model name, the tokenizer of the model files."""
    return [
        str(vllm),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(level.input_len),
        "--random-output-len",
        str(level.output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(level.num_prompts),
        "--max-concurrency",
        str(level.concurrency),
        "--seed",
        str(level.seed),
        "--ignore-eos",
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_json.parent),
        "--result-filename",
        out_json.name,
    ]


def parse_vllm(fig: dict) -> Figures:
    """`Figures` from ``vllm bench serve --save-result``'s object (milliseconds in its keys)."""
    completed = int(fig.get("completed") or 0)
    num = int(fig.get("num_prompts") or completed)
    return Figures(
        tok_s=fig["output_throughput"],
        ttft_med_s=fig["median_ttft_ms"] / 1e3,
        ttft_p99_s=fig["p99_ttft_ms"] / 1e3,
        tpot_med_ms=fig["median_tpot_ms"],
        failed=max(0, num - completed),
        errors="; ".join(e for e in fig.get("errors", []) if e)[:300] if isinstance(fig.get("errors"), list) else "",
    )


def read_figures(client: str, out_json: Path) -> Figures:
    fig = json.loads(out_json.read_text())
    return parse_light(fig) if client == "light" else parse_vllm(fig)
