"""Concurrent streaming clients that sort every request's outcome by kind (fault tests, benchmarks).

`StreamClients` runs ``n`` threads, each with its own ``httpx.Client`` (one pooled keep-alive
connection per client, reused request after request, as SDK clients do), sending streaming
``/v1/completions`` requests back to back until stopped. Each client may send its own body
(``bodies``; `mixed_bodies`: some long streams beside short ones). Each request ends as one
`Outcome`:

* ``ok`` — HTTP 200, then the usage chunk with the request's full ``max_tokens``, then
  ``data: [DONE]`` (nothing less is ok);
* ``short`` — ``[DONE]`` after fewer tokens (or no usage chunk) and no error: a stream cut
  short silently;
* ``error_event`` — the stream ended with an OpenAI error event and ``[DONE]`` (a clean error);
* ``http_NNN`` — a non-200 answer (``retry_after`` records a 503's ``Retry-After``);
* ``refused`` — the connection was refused (nobody listens: after a SIGTERM);
* ``cut`` — the stream broke before ``[DONE]``: reset, EOF (a 200 whose body stops), a
  protocol error, an event that is not JSON;
* ``hang`` — no byte for ``read_timeout`` seconds;
* ``cancelled`` — abandoned by `StreamClients.stop` (``cancel=True``): not a server's doing.

Each outcome has its client's index, the ``max_tokens`` it asked for, whether ``[DONE]`` came,
its start and end (``time.monotonic()``) and the client's local port (of the connection the
request went on, even when no response came), so a test can tell which requests were on a
process it killed. httpx only: no torch here.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import httpx

DEFAULT_BODY: dict[str, Any] = {
    "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
    "max_tokens": 32,
    "ignore_eos": True,
    "temperature": 0,
    "stream_options": {"include_usage": True},
}


@dataclasses.dataclass
class Outcome:
    kind: str
    started: float
    ended: float
    port: int | None = None
    detail: str = ""
    retry_after: str | None = None
    tokens: int = 0  # completion tokens the usage chunk gave (0 without one)
    max_gap: float = 0.0  # longest wait between two events of the stream, s
    client: int = 0  # index of the client thread that sent it
    max_tokens: int = 0  # what it asked for
    done: bool = False  # ``data: [DONE]`` came
    events: int = 0  # data events before [DONE] (how far a stream got)

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def mixed_bodies(n: int, long: int, long_tokens: int, short_tokens: int) -> list[dict[str, Any]]:
    """Per-client bodies for `StreamClients`: the first ``long`` clients ask for
    ``long_tokens``, the other ``n - long`` for ``short_tokens``."""
    if not 0 <= long <= n:
        raise ValueError(f"long must be in 0..{n}, got {long}")
    return [{"max_tokens": long_tokens if i < long else short_tokens} for i in range(n)]


class StreamClients:
    """``n`` threads streaming completions to ``url`` until `stop` (see module docstring).

    ``body`` is merged into every request (``prompt`` token ids, ``max_tokens``), then
    ``bodies[i]`` into client ``i``'s (``n`` dicts, e.g. `mixed_bodies`); ``stop_on`` lists
    outcome kinds after which a thread stops (``refused``: the server is gone). A 503's
    ``Retry-After`` is honoured, as the openai client does.
    """

    def __init__(
        self,
        url: str,
        n: int = 32,
        *,
        body: dict[str, Any] | None = None,
        bodies: Sequence[dict[str, Any]] | None = None,
        read_timeout: float = 30.0,
        stop_on: tuple[str, ...] = ("refused",),
    ) -> None:
        if bodies is not None and len(bodies) != n:
            raise ValueError(f"bodies: {len(bodies)} given for {n} clients")
        self.url = url.rstrip("/")
        self.body = {**DEFAULT_BODY, **(body or {})}
        self.bodies = [{**self.body, **(bodies[i] if bodies else {}), "stream": True} for i in range(n)]
        self.read_timeout = read_timeout
        self.stop_on = stop_on
        self.outcomes: list[Outcome] = []
        self.inflight: dict[int, tuple[float, int | None]] = {}  # thread index -> (started, port)
        self._ports: dict[int, int | None] = {}  # thread index -> local port of its connection
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._cancel = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True, name=f"stream-client-{i}") for i in range(n)
        ]
        for t in self._threads:
            t.start()

    # ---- control ---------------------------------------------------------------------------

    def stop(self, timeout: float = 60.0, *, cancel: bool = False) -> list[Outcome]:
        """Let every thread finish its request, then return all outcomes. ``cancel``: a stream
        still running is abandoned at its next event instead (closing its connection) and
        recorded as ``cancelled``, so a long stream does not have to run to its end."""
        if cancel:
            self._cancel.set()
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return list(self.outcomes)

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        """Block until ``count`` more requests ended ok (the load is flowing)."""
        start = self.counts()["ok"]
        deadline = time.monotonic() + timeout
        while self.counts()["ok"] < start + count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} requests ended ok in {timeout} s: {dict(self.counts())}")
            time.sleep(0.02)

    def wait_started(self, clients: Iterable[int], after: float, timeout: float = 60.0) -> int:
        """Block until one of ``clients`` has a request in flight that started after ``after``
        (``time.monotonic()``); returns that client's index."""
        clients = set(clients)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                for i, (started, _) in self.inflight.items():
                    if i in clients and started > after:
                        return i
            time.sleep(0.005)
        raise TimeoutError(f"none of clients {sorted(clients)} started a request in {timeout} s")

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
                    self._stop.wait(_retry_delay(outcome.retry_after))

    def _one(self, client: httpx.Client, index: int) -> Outcome:
        started = time.monotonic()
        body = self.bodies[index]
        conn: dict[str, int | None] = {"port": self._ports.get(index)}  # a reused connection's
        stream = _Stream()

        def trace(event: str, info: dict[str, Any]) -> None:  # httpcore's trace extension
            if event == "connection.connect_tcp.complete":  # a new connection: its port
                addr = info["return_value"].get_extra_info("client_addr")
                conn["port"] = self._ports[index] = addr[1] if addr else None

        def outcome(kind: str, port: int | None, detail: str = "", retry_after: str | None = None) -> Outcome:
            return Outcome(
                kind,
                started,
                time.monotonic(),
                port,
                detail,
                retry_after,
                tokens=stream.tokens,
                max_gap=stream.max_gap,
                client=index,
                max_tokens=body["max_tokens"],
                done=stream.done,
                events=stream.events,
            )

        port = None
        with self._lock:
            self.inflight[index] = (started, None)
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body, extensions={"trace": trace}) as r:
                port = _client_port(r)
                with self._lock:
                    self.inflight[index] = (started, port)
                if r.status_code != 200:
                    r.read()
                    return outcome(f"http_{r.status_code}", port, r.text[:200], r.headers.get("retry-after"))
                if not stream.read(r, self._cancel):
                    return outcome("cancelled", port, f"cancelled by the client {stream.progress()}")
        except httpx.ConnectError as exc:
            kind = "refused" if "refused" in str(exc).lower() else "cut"
            return outcome(kind, port, str(exc))
        except httpx.ReadTimeout as exc:
            return outcome("hang", port or conn["port"], f"{exc} {stream.progress()}")
        except (httpx.TransportError, httpx.StreamError) as exc:
            return outcome("cut", port or conn["port"], f"{type(exc).__name__}: {exc} {stream.progress()}")
        except (ValueError, KeyError, TypeError) as exc:  # an event that is not JSON, a usage without its count
            return outcome("cut", port, f"malformed event: {exc!r} {stream.progress()}")
        kind, detail = stream.classify(body["max_tokens"])
        return outcome(kind, port, detail)


class _Stream:
    """What one response's server-sent events said, as they are read."""

    def __init__(self) -> None:
        self.events = 0  # data events before [DONE]
        self.tokens = 0
        self.usage = False
        self.error: str | None = None
        self.done = False
        self.max_gap = 0.0

    def read(self, r: httpx.Response, cancel: threading.Event) -> bool:
        """Read ``r`` to its end (so the connection is reused); False if ``cancel`` was set first."""
        last = time.monotonic()
        for line in r.iter_lines():
            if not line.startswith("data: ") or self.done:
                continue
            if cancel.is_set():
                return False
            now = time.monotonic()
            self.max_gap, last = max(self.max_gap, now - last), now
            data = line[len("data: ") :]
            if data == "[DONE]":
                self.done = True
                continue
            self.events += 1
            event = json.loads(data)
            if not isinstance(event, dict):
                raise ValueError(f"not an object: {data[:80]}")
            if "error" in event:
                err = event["error"]
                self.error = (err.get("message") if isinstance(err, dict) else None) or str(err)
            elif event.get("usage"):
                self.usage = True
                self.tokens = event["usage"]["completion_tokens"]
        return True

    def progress(self) -> str:
        return f"(after {self.events} events{', [DONE]' if self.done else ''})"

    def classify(self, max_tokens: int) -> tuple[str, str]:
        """The kind and detail of a response read to its end."""
        if not self.done:
            why = f"; error event: {self.error}" if self.error is not None else ""
            return "cut", f"the stream ended without [DONE] {self.progress()}{why}"
        if self.error is not None:
            return "error_event", self.error
        if not self.usage:
            return "short", f"no usage chunk {self.progress()}"
        if self.tokens != max_tokens:
            return "short", f"{self.tokens} of {max_tokens} tokens"
        return "ok", ""


def _retry_delay(value: str) -> float:
    try:
        return min(max(float(value), 0.0), 10.0)
    except ValueError:  # an HTTP date or junk: a second
        return 1.0


def _client_port(r: httpx.Response) -> int | None:
    stream = r.extensions.get("network_stream")
    if stream is None:
        return None
    addr = stream.get_extra_info("client_addr")
    return addr[1] if addr else None


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Requests sent / ok / failed / unavailable / truncated / done and the count of each kind.

    ``refused`` is not counted as sent: the connection never reached a server (after a
    SIGTERM, refusing is the contract), nor is ``cancelled`` (the client gave up on it);
    ``unavailable`` are 503s with ``Retry-After`` (no
    engine core, nothing started); ``truncated`` are streams that stopped early without saying
    why (``short`` and ``cut``); ``done`` the requests whose stream ended with ``[DONE]``."""
    kinds = collections.Counter(o.kind for o in outcomes)
    unavailable = sum(1 for o in outcomes if o.kind == "http_503" and o.retry_after)
    failed = sum(n for k, n in kinds.items() if k not in ("ok", "refused", "cancelled")) - unavailable
    sent = sum(n for k, n in kinds.items() if k not in ("refused", "cancelled"))
    return {
        "sent": sent,
        "ok": kinds["ok"],
        "failed": failed,
        "unavailable": unavailable,
        "truncated": kinds["short"] + kinds["cut"],
        "done": sum(1 for o in outcomes if o.done),
        "kinds": dict(kinds),
    }
