"""Crash recovery: dead children are restarted with backoff; a crash loop ends the daemon."""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime

from supervisor_helpers import pid_alive

from pkgd.config.sections import SupervisorConfig
from pkgd.supervisor.restart import RestartPolicy


def test_backoff_doubles_up_to_the_cap_and_gives_up_past_max_restarts():
    policy = RestartPolicy(
        SupervisorConfig(restart_backoff=0.5, restart_backoff_max=1.5, max_restarts=4, restart_window=10)
    )
    assert [policy.record_crash(t) for t in (0, 1, 2, 3)] == [0.5, 1.0, 1.5, 1.5]
    assert policy.record_crash(4) is None  # 5th crash within 10 s
    assert policy.crashes_in_window(13.5) == 1  # old crashes age out of the window
    assert policy.record_crash(13.5) == 1.0


def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_killed_engine_core_is_restarted_with_backoff_and_serves_again(start_daemon):
    d = start_daemon({"supervisor": {"restart_backoff": 0.6}})
    d.wait_ready()
    old = d.child_pids()["engine-core-0"]
    api = d.child_pids()["api-server-0"]
    mark = d.mark()
    os.kill(old, signal.SIGKILL)
    died = d.wait_event("child_died", after=mark)
    assert died["child"] == "engine-core-0" and died["how"] == "signal SIGKILL"
    assert d.wait_event("child_restart_scheduled", after=mark)["delay_s"] == 0.6
    restarted = d.wait_event("child_restarted", after=mark)
    waited = datetime.fromisoformat(restarted["timestamp"]) - datetime.fromisoformat(died["timestamp"])
    assert waited.total_seconds() >= 0.6  # waited the backoff
    new = restarted["child_pid"]
    assert new != old and d.child_pids()["engine-core-0"] == new
    r = wait_for(lambda: (resp := d.get("/generate")).status_code == 200 and resp)
    assert r.json()["engine_pid"] == new and r.json()["api_pid"] == api  # same API server, reconnected
    child = next(c for c in d.status()["children"] if c["role"] == "engine-core")
    assert child["restarts"] == 1 and child["state"] == "ready"


def test_killed_api_server_is_restarted_while_the_other_keeps_serving(start_daemon):
    d = start_daemon({"frontend": {"api_server_count": 2}, "supervisor": {"restart_backoff": 2.0}})
    d.wait_ready()
    pids = d.child_pids()
    mark = d.mark()
    os.kill(pids["api-server-0"], signal.SIGKILL)
    d.wait_event("child_died", after=mark)
    answers = [d.get("/generate") for _ in range(20)]  # during the 2 s backoff (on a busy host, past it)
    assert all(r.status_code == 200 for r in answers)
    restarted = d.wait_event("child_restarted", after=mark)
    assert restarted["child"] == "api-server-0"
    served_by = [r.json()["api_pid"] for r in answers]
    assert served_by[0] == pids["api-server-1"]  # the survivor answers at once
    assert set(served_by) <= {pids["api-server-1"], restarted["child_pid"]}  # never the killed one
    now = d.child_pids()
    assert now["api-server-1"] == pids["api-server-1"] and now["engine-core-0"] == pids["engine-core-0"]
    seen = wait_for(lambda: {d.get("/whoami").json()["pid"] for _ in range(30)} >= {now["api-server-0"]}, 10)
    assert seen


def test_crash_loop_exits_non_zero_and_leaves_nothing(start_daemon):
    d = start_daemon({"supervisor": {"max_restarts": 2, "restart_backoff": 0.1}})
    d.wait_ready()
    for crash in range(3):
        mark = d.mark()
        os.kill(d.child_pids()["engine-core-0"], signal.SIGKILL)
        if crash < 2:
            d.wait_event("child_restarted", after=mark)
    assert d.wait_exit(30) == 1  # the third crash within restart_window is one too many
    assert len(d.find("child_died")) == 3
    assert "supervisor.max_restarts" in d.find("crash_loop")[0]["reason"]
    assert not [p for p in d.all_child_pids() if pid_alive(p)]


def test_engine_that_keeps_crashing_by_itself_ends_the_daemon(start_daemon):
    d = start_daemon(
        {"model": {"source": "fake:crash_after=3"}, "supervisor": {"max_restarts": 1, "restart_backoff": 0.1}}
    )
    d.wait_ready()
    assert d.wait_exit(30) == 1
    assert [e["how"] for e in d.find("child_died")] == ["exit code 3", "exit code 3"]


def test_restart_that_fails_to_start_counts_as_a_crash(start_daemon, tmp_path):
    marker = tmp_path / "die"  # once it exists, the fake engine dies before it is ready
    d = start_daemon(
        {"model": {"source": f"fake:die_if={marker}"}, "supervisor": {"max_restarts": 1, "restart_backoff": 0.1}}
    )
    d.wait_ready()
    marker.touch()
    os.kill(d.child_pids()["engine-core-0"], signal.SIGKILL)
    assert d.wait_exit(30) == 1
    assert d.find("child_restart_failed") and d.find("crash_loop")
