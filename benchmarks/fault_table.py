"""Fault table: the fault suite's cases as figures, and the stall one big request causes.

Starts one real daemon (``pkgd serve``: one engine core, two API servers) serving the fault
suite's tiny random-weight Llama with SmolLM2's tokenizer, runs 32 streaming clients on
keep-alive connections, and prints, per case, requests sent / ok / failed (by kind; a 503
with Retry-After while no engine core is up is counted apart) and the recovery time:

* ``--rounds`` rounds each of (a) a frontend reload and (b) an engine reload;
* (d) kill -9 of one of the two API servers and (e) kill -9 of the engine core, recovery =
  seconds from the kill to the replacement's ready frame;
* (c) SIGTERM drain;
* then, on a daemon with ``supervisor.drain_timeout`` of a few seconds, long streams (8 clients
  asking 4,000 tokens, each stream several times ``drain_timeout`` long, beside 24 short ones,
  all keep-alive and back to back): ``--long-rounds`` rounds each of an api-class reload, an
  engine-class reload by overlap and one by stop_first (no request may fail: the replaced
  generation finishes what it accepted), then a SIGTERM, which cuts the long streams still
  running at ``drain_timeout``: there they are expected to end with an error event and
  ``[DONE]`` (the row says so); each row also counts the streams cut short without an error
  (``short`` and ``cut``: truncated) and those that ended with ``[DONE]``;
* then, on a daemon with one API server, the stall: the longest gap between two events any
  stream sees, and the slowest ``/health`` answer, while one request after another carries
  the largest body ``frontend.limits`` allow (several shapes of it), next to the same figures
  over a window just before (target: under 100 ms); the first row is the server's first large
  body, sent once.

The cases are the fault suite's (``tests/faults/cases.py``). Figures are noisy on a shared
host: compare the stall with the baseline gap measured in the same run. The clients run in
this process, so its own pauses would read as the server's: its heap is frozen out of the
cyclic GC, and the last column is the longest pause it still had (a gap no longer than that
may be the client's).

    .venv/bin/python benchmarks/fault_table.py [--rounds 10] [--long-rounds 1] [--json FILE]
    .venv/bin/python benchmarks/fault_table.py --long-only   # only the long-stream rows
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "supervisor"), str(ROOT / "tests" / "faults")]

import httpx  # noqa: E402
from cases import (  # noqa: E402
    BENCH_MIX,
    CLIENTS,
    LONG_DRAIN_TIMEOUT,
    Case,
    build_fault_model,
    engine_reload,
    fault_config,
    frontend_reload,
    kill_api_server,
    kill_engine_core,
    long_api_reload,
    long_engine_reload,
    long_sigterm,
    long_stream_config,
    sigterm,
)
from supervisor_helpers import Daemon, merge  # noqa: E402

from pkgd.benchmarks.streams import StreamClients  # noqa: E402
from pkgd.config.vllm_config import VllmConfig  # noqa: E402


def largest_bodies() -> dict[str, dict]:
    """Request bodies at the default ``frontend.limits`` and ``max_request_body_bytes``."""
    limits = VllmConfig().frontend.limits
    body_bytes = VllmConfig().frontend.max_request_body_bytes
    per_message = limits.max_input_chars // limits.max_messages - len("role") - len("user") - len("content") - 3
    many = [{"role": "user", "content": "ab " * (per_message // 3)} for _ in range(limits.max_messages)]
    ints = (body_bytes - 200) // 6  # "12345," per token id (compact JSON)
    return {
        f"chat: {limits.max_messages} messages, {limits.max_input_chars} chars": {
            "path": "/v1/chat/completions",
            "json": {"messages": many, "max_tokens": 1},
        },
        f"completion: one {limits.max_input_chars}-char prompt": {
            "path": "/v1/completions",
            "json": {"prompt": "word " * (limits.max_input_chars // 5), "max_tokens": 1},
        },
        f"completion: {ints} token ids ({body_bytes >> 20} MiB)": {
            "path": "/v1/completions",
            "json": {"prompt": [12345] * ints, "max_tokens": 1},
        },
        f"chat: {body_bytes >> 20} MiB of chat_template_kwargs numbers": {
            "path": "/v1/chat/completions",
            "json": {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "chat_template_kwargs": {"x": [12345] * ints},
            },
        },
    }


class _Probe:
    """A daemon thread recording ``(time, seconds)`` samples until `stop`; `worst` over a window."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def worst(self, a: float, b: float) -> float:
        return max((value for t, value in self.samples if a <= t <= b), default=float("nan"))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


class HealthProbe(_Probe):
    """``GET /health`` every ``interval`` s on one kept-alive connection; each latency, s."""

    def __init__(self, url: str, interval: float = 0.02) -> None:
        self.url, self.interval = url, interval
        super().__init__()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                client.get(self.url + "/health")
                self.samples.append((t, time.monotonic() - t))
                self._stop.wait(self.interval)


class PauseProbe(_Probe):
    """This process's own pauses (a 5 ms ticker thread; samples are (end, length)): its cyclic
    GC or the host's scheduler can freeze every client thread at once, which looks like a stall
    of the server."""

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.005):
            now = time.monotonic()
            self.samples.append((now, now - last - 0.005))
            last = now


def stall(d: Daemon, seconds: float) -> list[dict]:
    """Per body shape: the longest gap between two events of any stream, and the slowest
    ``/health`` answer, while that body is sent again and again, beside the same figures over
    a window just before without it. ``d`` runs one API server, so every stream, the probe and
    the big request share its event loop. The first row is the first large body the server
    sees, sent once (it may wait for the preprocessing process to finish starting)."""
    bodies = list(largest_bodies().items())
    first_name, first = bodies[0]
    rows = [_stall_row(d, f"first large body after start: {first_name}", first, seconds, once=True)]
    rows += [_stall_row(d, name, request, seconds) for name, request in bodies]
    return rows


def _stall_row(d: Daemon, name: str, request: dict, seconds: float, once: bool = False) -> dict:
    data = json.dumps(request["json"], separators=(",", ":")).encode()
    load = StreamClients(d.url, CLIENTS)
    load.wait_for(CLIENTS)
    probe, pauses = HealthProbe(d.url), PauseProbe()
    t0 = time.monotonic()
    time.sleep(seconds)
    t1 = time.monotonic()
    statuses, big_s = [], []
    with httpx.Client(timeout=120) as client:
        while not big_s or (not once and time.monotonic() < t1 + seconds):
            start = time.monotonic()
            r = client.post(d.url + request["path"], content=data, headers={"content-type": "application/json"})
            big_s.append(time.monotonic() - start)
            statuses.append(r.status_code)
    t2 = time.monotonic()
    probe.stop()
    pauses.stop()
    outcomes = load.stop()

    def worst_gap(a: float, b: float) -> float:
        gaps = [o.max_gap for o in outcomes if o.started >= a and o.ended <= b and o.kind == "ok"]
        return max(gaps, default=float("nan"))

    return {
        "body": name,
        "body_mib": round(len(data) / 2**20, 2),
        "statuses": sorted(set(statuses)),
        "big_requests": len(big_s),
        "big_request_s": round(statistics.median(big_s), 3),
        "baseline_gap_ms": round(1e3 * worst_gap(t0, t1), 1),
        "worst_gap_ms": round(1e3 * worst_gap(t1, t2), 1),
        "baseline_health_ms": round(1e3 * probe.worst(t0, t1), 1),
        "worst_health_ms": round(1e3 * probe.worst(t1, t2), 1),
        "client_pause_ms": round(1e3 * max(pauses.worst(t0, t1), pauses.worst(t1, t2)), 1),
    }


def loop_lag(repeats: int = 3) -> list[dict]:
    """In one process, without network or clients: the longest event-loop lag (a 1 ms ticker
    on the loop) while an API server's `Preprocessor` parses, templates and tokenizes each
    largest body, beside the longest lag over an idle window just as long; with the start-up
    heap frozen (as the API server does) and, for the ratio, not frozen. Windows alternate
    and repeat; the median of each kind is reported (a shared host's noise is large)."""
    import asyncio

    from api.fakes import FakeEngineClient
    from fastapi.exceptions import RequestValidationError

    from pkgd.api import serving_chat, serving_completion
    from pkgd.api.errors import APIError
    from pkgd.api.state import ServerState
    from pkgd.frontend.async_llm import AsyncLLM, load_frontend_tokenizer

    async def window(work) -> float:
        lags: list[float] = []
        stop = False

        async def tick() -> None:
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                lags.append(now - last - 0.001)
                last = now

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.01)
        await work()
        stop = True
        await ticker
        return max(lags)

    async def run() -> list[dict]:
        cfg = VllmConfig()
        tok = load_frontend_tokenizer(cfg)
        llm = AsyncLLM(
            cfg, ["ipc:///unused"], tokenizer=tok, client_factory=lambda sink: FakeEngineClient(sink, lambda r: [1])
        )
        await llm.start(handshake_timeout=1)
        state = ServerState(cfg, llm, None)
        out = []
        for name, request in largest_bodies().items():
            raw = json.dumps(request["json"], separators=(",", ":")).encode()
            prepare = serving_chat._prepare if "chat" in request["path"] else serving_completion._prepare
            took: list[float] = []
            refusals: set[str] = set()

            async def work() -> None:
                t = time.perf_counter()
                try:
                    await state.preprocess.run(prepare, state, raw, "r", None)
                except (APIError, RequestValidationError) as exc:  # refused after the work (too long a prompt)
                    refusals.add(str(exc)[:120])
                took.append(time.perf_counter() - t)

            async def idle() -> None:
                await asyncio.sleep(took[-1] if took else 0.5)

            lags: dict[str, list[float]] = {"idle": [], "not frozen": [], "frozen": []}
            for _ in range(repeats):
                for frozen in (False, True):
                    if frozen:
                        gc.collect()
                        gc.freeze()
                    lags["frozen" if frozen else "not frozen"].append(await window(work))
                    lags["idle"].append(await window(idle))
                    gc.unfreeze()
            out.append(
                {
                    "body": name,
                    "work_s": round(statistics.median(took), 2),
                    "refused": sorted(refusals),
                    **{f"{k}_lag_ms": round(1e3 * statistics.median(v), 1) for k, v in lags.items()},
                }
            )
        return out

    return asyncio.run(run())


HEADER = (
    f"{'case':<31} {'round':>5} {'sent':>6} {'ok':>6} {'failed':>7} {'503':>6} {'trunc':>6} {'[DONE]':>6} "
    f"{'recovery s':>10}  outcomes other than ok"
)


def show(case: Case, round_: int | str = "", expected: str = "") -> dict:
    """Print one row: failed / sent, truncated (short + cut), ended with [DONE], and each
    kind but ok (with how many were long streams, in a long-stream case); ``expected`` names
    failures the row is meant to have."""
    s = case.summary
    long = case.long()
    kinds = ", ".join(
        f"{k} {n}" + (f" (long {sum(1 for o in long if o.kind == k)})" if long else "")
        for k, n in sorted(s["kinds"].items())
        if k != "ok"
    )
    rec = f"{case.recovery_s:.2f}" if case.recovery_s is not None else "-"
    print(
        f"{case.name:<31} {round_!s:>5} {s['sent']:>6} {s['ok']:>6} {s['failed']:>7} {s['unavailable']:>6} "
        f"{s['truncated']:>6} {s['done']:>6} {rec:>10}  {kinds}{'  ' + expected if expected else ''}",
        flush=True,
    )
    info = {k: v for k, v in case.info.items() if k in ("reload_s", "old_drain_s", "old_exited", "exit_code")}
    return {"case": case.name, "round": round_, **s, "recovery_s": case.recovery_s, **info}


def _totals(rows: list[dict], names: tuple[str, ...]) -> None:
    for name in names:
        mine = [x for x in rows if x.get("case") == name]
        print(
            f"{name:<31} {'total':>5} {sum(x['sent'] for x in mine):>6} {sum(x['ok'] for x in mine):>6} "
            f"{sum(x['failed'] for x in mine):>7} {sum(x['unavailable'] for x in mine):>6} "
            f"{sum(x['truncated'] for x in mine):>6} {sum(x['done'] for x in mine):>6}"
        )


def fault_rounds(d: Daemon, rounds: int) -> list[dict]:
    """The fault cases on daemon ``d`` (two API servers): ``rounds`` of (a) and (b), then (d),
    (e) and (c), a row each, printed as they end."""
    t = time.monotonic()
    d.wait_ready(300)
    print(f"daemon ready in {time.monotonic() - t:.1f} s at {d.url}; {CLIENTS} streaming clients", flush=True)
    print(HEADER)
    rows = [show(frontend_reload(d, 6.0 + r % 2), r) for r in range(rounds)]
    rows += [show(engine_reload(d, 128 + r % 2), r) for r in range(rounds)]
    rows += [show(kill_api_server(d)), show(kill_engine_core(d))]
    _totals(rows, ("frontend reload", "engine reload"))
    print()
    rows.append(show(sigterm(d)))
    return rows


def long_rounds(d: Daemon, rounds: int) -> list[dict]:
    """The long-stream cases on daemon ``d`` (`long_stream_config`): ``rounds`` of an api
    reload, an engine reload by overlap and one by stop_first, then SIGTERM; a row each."""
    t = time.monotonic()
    d.wait_ready(300)
    print(
        f"\nlong streams (daemon ready in {time.monotonic() - t:.1f} s, supervisor.drain_timeout "
        f"{LONG_DRAIN_TIMEOUT:g} s): {BENCH_MIX}, keep-alive, back to back",
        flush=True,
    )
    print(HEADER)
    rows = []
    for r in range(rounds):
        rows.append(show(long_api_reload(d, BENCH_MIX), r))
        rows.append(show(long_engine_reload(d, BENCH_MIX, "overlap"), r))
        rows.append(show(long_engine_reload(d, BENCH_MIX, "stop_first"), r))
    if rounds > 1:
        _totals(rows, tuple(dict.fromkeys(x["case"] for x in rows)))
    print()
    expected = f"(expected: long streams past drain_timeout {LONG_DRAIN_TIMEOUT:g} s end with error_event + [DONE])"
    rows.append(show(long_sigterm(d, BENCH_MIX), expected=expected))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds of (a) and (b)")
    ap.add_argument("--stall-seconds", type=float, default=3.0, help="length of each stall window and of its baseline")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--lag-only", action="store_true", help="only the in-process event-loop lag")
    ap.add_argument("--stall-only", action="store_true", help="only the lag and the stall: no fault cases")
    ap.add_argument("--long-rounds", type=int, default=1, help="rounds of the long-stream reloads")
    ap.add_argument("--long-only", action="store_true", help="only the long-stream rows")
    ap.add_argument(
        "--log",
        type=Path,
        default=Path(tempfile.gettempdir()) / "pkgd-fault_table.log",
        help="the daemons' log lines go here (default: %(default)s)",
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pkgd-ft-", dir="/tmp"))
    rows: list[dict] = []
    d = None
    if not args.long_only:
        print("event-loop lag in one process while the preprocess pool handles the largest bodies (median of 3):")
        print(f"{'body':<46} {'work s':>6} {'idle ms':>8} {'heap not frozen ms':>18} {'frozen (pkgd) ms':>16}")
        for row in loop_lag():
            rows.append(row)
            print(
                f"{row['body']:<46} {row['work_s']:>6} {row['idle_lag_ms']:>8} {row['not frozen_lag_ms']:>18} "
                f"{row['frozen_lag_ms']:>16}  {'; '.join(row['refused']) or 'accepted'}",
                flush=True,
            )
    if args.lag_only:
        return 0
    print()
    build_fault_model(work / "tiny")
    # This process's heap (torch, transformers) is large: a full collection of it pauses every
    # client thread ~200 ms, which the streams would report as a stall of the server.
    gc.collect()
    gc.freeze()
    try:
        if not args.stall_only and not args.long_only:
            (work / "d").mkdir()
            d = Daemon(work / "d", fault_config(work / "tiny"), real=True)
            rows.extend(fault_rounds(d, args.rounds))
            d.cleanup()
        if not args.stall_only:
            (work / "l").mkdir()
            d = Daemon(work / "l", long_stream_config(work / "tiny"), real=True)
            rows.extend(long_rounds(d, args.long_rounds))
        if not args.long_only:
            if d is not None:
                d.cleanup()
            (work / "s").mkdir()
            d = Daemon(work / "s", merge(fault_config(work / "tiny"), {"frontend": {"api_server_count": 1}}), real=True)
            d.wait_ready(300)
            print(
                "\nstall of the other streams while one request carries the largest body the limits allow "
                "(one API server):"
            )
            print(
                f"{'body':<70} {'MiB':>4} {'status':>6} {'sent':>4} {'big s':>6} {'gap ms: before':>14} "
                f"{'during':>7} {'/health ms: before':>18} {'during':>7} {'client pause ms':>15}"
            )
            for row in stall(d, args.stall_seconds):
                rows.append(row)
                print(
                    f"{row['body']:<70} {row['body_mib']:>4} {','.join(map(str, row['statuses'])):>6} "
                    f"{row['big_requests']:>4} {row['big_request_s']:>6} "
                    f"{row['baseline_gap_ms']:>14} {row['worst_gap_ms']:>7} {row['baseline_health_ms']:>18} "
                    f"{row['worst_health_ms']:>7} {row['client_pause_ms']:>15}",
                    flush=True,
                )
    finally:
        if d is not None:
            args.log.write_text("\n".join(d.lines) + "\n")
            print(f"daemon log: {args.log}", flush=True)
            d.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=list))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
