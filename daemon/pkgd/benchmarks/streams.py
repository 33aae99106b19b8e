"""Concurrent streaming clients that sort every request's outcome by kind (fault tests, benchmarks).

`StreamClients` runs ``n`` threads, each with its own ``httpx.Client`` (one pooled keep-alive
connection per client, reused request after request, as SDK clients do), sending streaming
``/v1/completions`` requests back to back until stopped. Each request ends as one `Outcome`:

* ``ok`` — HTTP 200, ``max_tokens`` tokens (the usage chunk says), then ``data: [DONE]``;
* ``short`` — ``[DONE]`` after fewer tokens and no error (a stream cut short silently);
* ``error_event`` — the stream ended with an OpenAI error event and ``[DONE]`` (a clean error);
* ``http_NNN`` — a non-200 answer (``retry_after`` records a 503's ``Retry-After``);
* ``refused`` — the connection was refused (nobody listens: after a SIGTERM);
* ``cut`` — the connection broke before the stream's end (reset, EOF, protocol error);
* ``hang`` — no byte for ``read_timeout`` seconds.

Each outcome has its start and end (``time.monotonic()``) and the client's local port (of the
connection the request went on, even when no response came), so a test can tell which
requests were on a process it killed. httpx only: no torch here.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from typing import Any

import httpx


@dataclasses.dataclass
class Outcome:
    kind: str
    started: float
    ended: float
    port: int | None = None
    detail: str = ""
    retry_after: str | None = None
    tokens: int = 0
    max_gap: float = 0.0  # longest wait between two events of the stream, s

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


class StreamClients:
    """``n`` threads streaming completions to ``url`` until `stop` (see module docstring).

    ``body`` is merged into each request (``prompt`` token ids, ``max_tokens``); ``stop_on``
    lists outcome kinds after which a thread stops (``refused``: the server is gone). A 503's
    ``Retry-After`` is honoured, as the openai client does.
    """

    def __init__(
        self,
        url: str,
        n: int = 32,
        *,
        body: dict[str, Any] | None = None,
        read_timeout: float = 30.0,
        stop_on: tuple[str, ...] = ("refused",),
    ) -> None:
        self.url = url.rstrip("/")
        self.body = {
            "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
            "max_tokens": 32,
            "ignore_eos": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
            **(body or {}),
        }
        self.read_timeout = read_timeout
        self.stop_on = stop_on
        self.outcomes: list[Outcome] = []
        self.inflight: dict[int, tuple[float, int | None]] = {}  # thread index -> (started, port)
        self._ports: dict[int, int | None] = {}  # thread index -> local port of its connection
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True, name=f"stream-client-{i}") for i in range(n)
        ]
        for t in self._threads:
            t.start()

    # ---- control ---------------------------------------------------------------------------

    def stop(self, timeout: float = 60.0) -> list[Outcome]:
        """Let every thread finish its request, then return all outcomes."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        return self.outcomes

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        """Block until ``count`` more requests ended ok (the load is flowing)."""
        start = self.counts()["ok"]
        deadline = time.monotonic() + timeout
        while self.counts()["ok"] < start + count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} requests ended ok in {timeout} s: {dict(self.counts())}")
            time.sleep(0.02)

    def counts(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(o.kind for o in self.outcomes)

    def inflight_snapshot(self) -> list[tuple[float, int | None]]:
        with self._lock:
            return list(self.inflight.values())

    # ---- one client ------------------------------------------------------------------------

    def _run(self, index: int) -> None:
        timeout = httpx.Timeout(10.0, read=self.read_timeout)
        with httpx.Client(timeout=timeout) as client:
            while not self._stop.is_set():
                outcome = self._one(client, index)
                with self._lock:
                    self.inflight.pop(index, None)
                    self.outcomes.append(outcome)
                if outcome.kind in self.stop_on:
                    return
                if outcome.retry_after:
                    self._stop.wait(min(float(outcome.retry_after), 10.0))

    def _one(self, client: httpx.Client, index: int) -> Outcome:
        started = time.monotonic()
        conn: dict[str, int | None] = {"port": self._ports.get(index)}  # a reused connection's

        def trace(event: str, info: dict[str, Any]) -> None:  # httpcore's trace extension
            if event == "connection.connect_tcp.complete":  # a new connection: its port
                addr = info["return_value"].get_extra_info("client_addr")
                conn["port"] = self._ports[index] = addr[1] if addr else None

        port = None
        with self._lock:
            self.inflight[index] = (started, None)
        try:
            with client.stream(
                "POST", f"{self.url}/v1/completions", json={**self.body, "stream": True}, extensions={"trace": trace}
            ) as r:
                port = _client_port(r)
                with self._lock:
                    self.inflight[index] = (started, port)
                if r.status_code != 200:
                    r.read()
                    return Outcome(
                        f"http_{r.status_code}",
                        started,
                        time.monotonic(),
                        port,
                        r.text[:200],
                        r.headers.get("retry-after"),
                    )
                return self._read_stream(r, started, port)
        except httpx.ConnectError as exc:
            kind = "refused" if "refused" in str(exc).lower() else "cut"
            return Outcome(kind, started, time.monotonic(), port, str(exc))
        except httpx.ReadTimeout as exc:
            return Outcome("hang", started, time.monotonic(), port or conn["port"], str(exc))
        except (httpx.TransportError, httpx.StreamError) as exc:
            return Outcome("cut", started, time.monotonic(), port or conn["port"], f"{type(exc).__name__}: {exc}")

    def _read_stream(self, r: httpx.Response, started: float, port: int | None) -> Outcome:
        tokens, error, done = 0, None, False
        last, max_gap = time.monotonic(), 0.0
        for line in r.iter_lines():  # to the body's end, so the connection is reused
            if not line.startswith("data: ") or done:
                continue
            now = time.monotonic()
            max_gap, last = max(max_gap, now - last), now
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                error = event["error"].get("message", "")
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        end = time.monotonic()
        kind, detail = "ok", ""
        if not done:
            kind, detail = "cut", "the stream ended without [DONE]"
        elif error is not None:
            kind, detail = "error_event", error
        elif tokens != self.body["max_tokens"]:
            kind, detail = "short", f"{tokens} tokens"
        return Outcome(kind, started, end, port, detail, tokens=tokens, max_gap=max_gap)


def _client_port(r: httpx.Response) -> int | None:
    stream = r.extensions.get("network_stream")
    if stream is None:
        return None
    addr = stream.get_extra_info("client_addr")
    return addr[1] if addr else None


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Requests sent / ok / failed / unavailable and the count of each kind. ``refused`` is not
    counted as sent: the connection never reached a server (after a SIGTERM, refusing is the
    contract); ``unavailable`` are 503s with ``Retry-After`` (no engine core, nothing started)."""
    kinds = collections.Counter(o.kind for o in outcomes)
    unavailable = sum(1 for o in outcomes if o.kind == "http_503" and o.retry_after)
    failed = sum(n for k, n in kinds.items() if k not in ("ok", "refused")) - unavailable
    sent = sum(n for k, n in kinds.items() if k != "refused")
    return {"sent": sent, "ok": kinds["ok"], "failed": failed, "unavailable": unavailable, "kinds": dict(kinds)}
