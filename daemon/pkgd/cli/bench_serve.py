"""``pkgd bench serve``: load an OpenAI-compatible server (vLLM's ``vllm bench serve``).

Sends ``--num-prompts`` completion requests of ``--input-len`` prompt tokens (random token
ids, so lengths are exact) asking for ``--output-len`` tokens (``ignore_eos``), at most
``--max-concurrency`` at a time, to ``--base-url``. Streaming by default; each request's
time to first token (TTFT), time per output token after the first (TPOT = (latency − TTFT) ÷
(tokens − 1)) and gaps between chunks (ITL) are measured on the client with the monotonic
clock; token counts come from the server's ``usage``. Prints requests/s, output and total
tokens/s, and median / mean / p99 of TTFT, TPOT and ITL. ``--no-stream`` measures plain
request throughput (with ``--output-len 1``: the frontend's per-request overhead).

Works against any OpenAI-compatible server (pkgd, vLLM); uses httpx only, so it runs beside
a server without importing torch.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from pkgd.benchmarks import plot
from pkgd.benchmarks.stats import latency_stats

DESCRIPTION = """\
Load a running OpenAI-compatible server (pkgd, vLLM, any other) as vllm bench serve does:
--num-prompts completion requests of --input-len random prompt tokens, each asking for
--output-len tokens, at most --max-concurrency at a time. Prints requests/s, output and
total tokens/s, and the median, mean and p99 of the time to first token (TTFT), the time per
output token after the first (TPOT), the gaps between streamed chunks (ITL) and the whole
request's latency, measured on the client. --no-stream measures plain request throughput."""

EXAMPLES = """\
examples:
  pkgd bench serve --num-prompts 64 --max-concurrency 8
  pkgd bench serve --base-url http://127.0.0.1:8001 --output-json vllm.json   (another server)
  pkgd bench serve --compare vllm.json --plot serve.png   (this server against that run)"""


DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url",
        default=None,
        help=f"server URL (without /v1); default http://HOST:PORT from --host/--port "
        f"(vllm bench serve's; default {DEFAULT_HOST}:{DEFAULT_PORT})",
    )
    # Not --model / --api-key / --seed: under `pkgd` those are config flags (frontend, model);
    # --host, --port and --model reach `apply_target_flags` that way.
    p.add_argument(
        "--model-name",
        dest="model",
        default=None,
        help="model name to send (default: --model, else the server's first)",
    )
    p.add_argument(
        "--bearer-token",
        dest="api_key",
        default=None,
        metavar="KEY",
        help="Bearer key, when the server wants one (default: $OPENAI_API_KEY)",
    )
    p.add_argument("--num-prompts", type=int, default=256, help="number of requests")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) first")
    p.add_argument("--random-seed", dest="seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    plot.add_plot_args(p)


@dataclasses.dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    itls: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    retried: bool = False
    closed_unanswered: bool = False  # the connection failed before a response status arrived


async def _one(http: httpx.AsyncClient, body: dict[str, Any]) -> RequestResult:
    """One request; sent again once, on a new connection, when the server closed the pooled
    one before answering (llama-server ends kept-alive connections as it likes), as the openai
    SDK retries a connection error. Its times count from the first try."""
    t0 = time.monotonic()
    res = await _attempt(http, body, t0)
    if res.closed_unanswered:
        res = await _attempt(http, body, t0)
        res.retried = True
    return res


async def _attempt(http: httpx.AsyncClient, body: dict[str, Any], t0: float) -> RequestResult:
    res = RequestResult(ok=False)
    answered = False
    try:
        if not body["stream"]:
            r = await http.post("/v1/completions", json=body)
            answered = True
            data = r.json()
            if r.status_code != 200:
                res.error = data.get("error", {}).get("message", r.text)
                return res
            res.prompt_tokens, res.output_tokens = data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"]
        else:
            last = None
            async with http.stream("POST", "/v1/completions", json=body) as r:
                answered = True
                if r.status_code != 200:
                    res.error = (await r.aread()).decode(errors="replace")
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = chunk["error"]["message"]
                        return res
                    now = time.monotonic()
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        if res.ttft is None:
                            res.ttft = now - t0
                        elif last is not None:
                            res.itls.append(now - last)
                        last = now
                    if chunk.get("usage"):
                        res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        res.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        res.closed_unanswered = not answered and isinstance(exc, (httpx.RemoteProtocolError, httpx.ConnectError))
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.monotonic() - t0
    res.ok = True
    return res


def _bodies(args: argparse.Namespace, model: str, n: int, rng: random.Random) -> list[dict[str, Any]]:
    extra = {"stream_options": {"include_usage": True}} if args.stream else {}
    return [
        {
            "model": model,
            "prompt": [rng.randrange(1000, 30000) for _ in range(args.input_len)],
            "max_tokens": args.output_len,
            "ignore_eos": True,
            "temperature": args.temperature,
            "stream": args.stream,
            **extra,
        }
        for _ in range(n)
    ]


class ServerAnswerError(Exception):
    """The server answered ``/v1/models`` with something other than a model list."""


async def _first_model(http: httpx.AsyncClient) -> str:
    """The first model ``/v1/models`` lists. Raises `ServerAnswerError` for another answer."""
    r = await http.get("/v1/models")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerAnswerError(
            f"{http.base_url}v1/models answered {r.status_code} without a model: {r.text[:200]}"
        ) from None


async def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """Run the load and return the figures."""
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    base_url = args.base_url or f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=None) as http:
        model = args.model or await _first_model(http)
        rng = random.Random(args.seed)
        for body in _bodies(args, model, args.warmup, rng):
            await _one(http, body)
        sem = asyncio.Semaphore(args.max_concurrency)

        async def limited(body: dict[str, Any]) -> RequestResult:
            async with sem:
                return await _one(http, body)

        bodies = _bodies(args, model, args.num_prompts, rng)
        t0 = time.monotonic()
        results = await asyncio.gather(*(limited(b) for b in bodies))
        elapsed = time.monotonic() - t0
    return summarize(args, model, results, elapsed)


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    return {
        "model": model,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "retried": sum(r.retried for r in results),
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "stream": args.stream,
        "elapsed_s": elapsed,
        "requests_per_s": len(ok) / elapsed,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "ttft_s": latency_stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": latency_stats(tpots),
        "itl_s": latency_stats([x for r in ok for x in r.itls]),
        "latency_s": latency_stats([r.latency for r in ok]),
    }


def print_report(fig: dict[str, Any]) -> None:
    print(
        f"pkgd bench serve: {fig['model']}, {fig['num_prompts']} requests, {fig['input_len']} -> "
        f"{fig['output_len']} tokens, "
        f"concurrency {fig['max_concurrency']}, {'streaming' if fig['stream'] else 'non-streaming'}"
    )
    print(
        f"Completed {fig['completed']} ({fig['failed']} failed, {fig['retried']} sent twice) in "
        f"{fig['elapsed_s']:.2f} s: "
        f"{fig['requests_per_s']:.2f} requests/s, {fig['output_tokens_per_s']:.1f} output tokens/s, "
        f"{fig['total_tokens_per_s']:.1f} total tokens/s"
    )
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("latency_s", "Latency")):
        s = fig[key]
        print(
            f"{label:8s} median {s['median'] * 1e3:9.1f} ms   mean {s['mean'] * 1e3:9.1f} ms   p99 "
            f"{s['p99'] * 1e3:9.1f} ms"
        )
    for err in fig["errors"]:
        print(f"error: {err}")


def apply_target_flags(args: argparse.Namespace, flags: Sequence[str]) -> list[str]:
    """vllm bench serve's ``--host``, ``--port`` and ``--model`` (which `pkgd` parses as config
    flags): the server ``args.base_url`` names when ``--base-url`` was not given, and the model
    name sent when ``--model-name`` was not. Returns the flags left over (no bench serve
    option), for the caller to refuse.

    Raises:
        ValueError: a flag without its value, or a port that is not a number in [1, 65535].
    """
    values: dict[str, str] = {}
    rest: list[str] = []
    tokens = list(flags)
    i = 0
    while i < len(tokens):
        name, eq, value = tokens[i].partition("=")
        if name not in ("--host", "--port", "--model"):
            rest.append(tokens[i])
            i += 1
            continue
        if not eq:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ValueError(f"{name} needs a value")
            value = tokens[i + 1]
            i += 1
        values[name] = value
        i += 1
    port = values.get("--port", str(DEFAULT_PORT))
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--port {port!r}: expected a port number in [1, 65535]")
    if args.base_url is None:
        args.base_url = f"http://{values.get('--host', DEFAULT_HOST)}:{port}"
    if args.model is None:
        args.model = values.get("--model")
    return rest


def run_serve(args: argparse.Namespace) -> int:
    """``pkgd bench serve`` (also ``python -m pkgd.cli.bench_serve``): exit 1 if any request
    failed or the server cannot be reached (one line, no traceback)."""
    previous = getattr(args, "previous_runs", None)
    if previous is None:  # run as python -m pkgd.cli.bench_serve: nothing checked it yet
        try:
            previous = plot.check_plot_args(args)
        except (plot.PlotUnavailable, ValueError) as e:
            print(f"pkgd bench serve: error: {e}", file=sys.stderr)
            return 2
    if args.base_url is None:
        args.base_url = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
    try:
        fig = asyncio.run(run_load(args))
    except httpx.TransportError as e:
        print(f"pkgd bench serve: error: cannot reach {args.base_url}: {e or type(e).__name__}", file=sys.stderr)
        return 1
    except ServerAnswerError as e:
        print(f"pkgd bench serve: error: {e}", file=sys.stderr)
        return 1
    print_report(fig)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(fig, f, indent=2)
    stream = "streaming" if fig["stream"] else "non-streaming"
    plot.report(
        [plot.series_from_figures(fig, args.base_url), *previous],
        args.plot,
        title=f"pkgd bench serve: {fig['model']}, {fig['num_prompts']} requests, {fig['input_len']} -> "
        f"{fig['output_len']} tokens, concurrency {fig['max_concurrency']}, {stream}",
    )
    return 1 if fig["failed"] else 0


def main(argv: list[str] | None = None) -> int:
    from pkgd.cli.parser import ArgumentParser

    parser = ArgumentParser(prog="pkgd bench serve", description=DESCRIPTION, epilog=EXAMPLES)
    add_serve_args(parser)
    return run_serve(parser.parse_command_line(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
