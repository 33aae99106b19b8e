"""The fault suite: 32 streaming clients on keep-alive connections against a real daemon (two
API servers, one engine core) while the daemon is reloaded, killed in part, and stopped.

What must hold: a reload of the frontend or of the engine fails no request; SIGTERM finishes
every stream in flight and refuses new connections (a refusal is not a failed request); a
kill -9 of one API server or of the engine core fails only the requests that were on the
killed process, each with an error (a cut connection, an error event, a 503 with
Retry-After), none hanging, and the daemon recovers. Run alone with ``-m faults``; the cases
share one daemon and run in order (SIGTERM last).
"""

from __future__ import annotations

import pytest
from cases import CLIENTS, engine_reload, frontend_reload, kill_api_server, kill_engine_core, sigterm

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def _show(case) -> str:
    ports = {k: sorted(v) for k, v in case.info.items() if k.startswith("on_")}
    return (
        f"{case.name}: {case.summary}; {ports}; first failures: "
        f"{[(o.kind, o.port, o.detail[:120]) for o in case.failures()[:5]]}"
    )


def test_a_frontend_reload_fails_no_stream(daemon):
    case = frontend_reload(daemon, 6.0)
    assert case.info["replaced"], "the API servers were not replaced"
    assert not case.failures(), _show(case)
    assert case.summary["ok"] >= 2 * CLIENTS


def test_an_engine_reload_fails_no_stream(daemon):
    case = engine_reload(daemon, 128)
    assert len(case.info["replaced"]) == 3, "engine core and both API servers are a new generation"
    assert not case.failures(), _show(case)
    assert case.summary["ok"] >= 2 * CLIENTS


def test_kill_9_of_one_api_server_fails_only_its_streams(daemon):
    case = kill_api_server(daemon)
    on_victim, on_survivor = case.info["on_victim"], case.info["on_survivor"]
    # Connections spread over both servers sharing the socket (not 29 of 32 on one).
    assert len(on_victim) >= CLIENTS // 4 and len(on_survivor) >= CLIENTS // 4, (len(on_victim), len(on_survivor))
    failures = case.failures()
    assert failures, "the killed server carried streams; they must end with an error"
    assert all(o.port in on_victim for o in failures), _show(case)
    assert all(o.kind in ("cut", "error_event") for o in failures), _show(case)  # ended, not hanging
    assert len(failures) <= len(on_victim)
    assert case.recovery_s is not None


def test_kill_9_of_the_engine_core_fails_only_its_streams(daemon):
    case = kill_engine_core(daemon)
    failures = case.failures()
    events = [o for o in failures if o.kind == "error_event"]
    unavailable = [o for o in failures if o.kind == "http_503"]
    assert events, "the streams in flight on the engine must end with an error event"
    assert len(events) <= case.info["inflight"] + CLIENTS // 4, _show(case)  # at most a few sent in the kill's moment
    assert all(o.started < case.info["killed_mono"] + 1.0 for o in events), _show(case)
    assert all(o.retry_after for o in unavailable), "a 503 says when to retry"
    assert all(o.started < case.info["recovered_mono"] for o in unavailable), _show(case)
    assert len(events) + len(unavailable) == len(failures), _show(case)  # no cut, short or hanging stream
    assert case.recovery_s is not None


def test_sigterm_drains_every_stream_and_refuses_new_connections(daemon):
    case = sigterm(daemon)
    assert case.info["exit_code"] == 0
    assert not case.failures(), _show(case)
    assert case.summary["ok"] >= case.info["inflight"]
    assert case.summary["kinds"].get("refused", 0) >= 1
