"""Start-up and shutdown of a real supervisor process (fake children, real sockets)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import threading
import time

import httpx
import pytest
from supervisor_helpers import pid_alive

from pkgd import host


def test_ready_line_then_sigterm_leaves_no_process(start_daemon):
    d = start_daemon({"frontend": {"api_server_count": 2}, "parallel": {"dp": 2}})
    url = d.wait_ready()
    port = int(url.rsplit(":", 1)[1])
    assert url == f"http://127.0.0.1:{port}" and port != 0  # port 0 resolved to the real one
    r = d.get("/generate")
    assert r.status_code == 200
    pids = d.all_child_pids()
    assert len(pids) == 4  # 2 engine cores + 2 API servers
    assert all(pid_alive(p) for p in pids)
    d.signal(signal.SIGTERM)
    assert d.wait_exit(20) == 0
    assert not [p for p in pids if pid_alive(p)]
    assert sorted(p.name for p in d.runtime_dir.iterdir()) == []  # sockets, metrics and lock removed
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


def test_port_in_use_exits_2_before_any_child(start_daemon):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = start_daemon({"frontend": {"port": port}})
        assert d.wait_exit(20) == 2
    err = d.find("startup_failed")[0]["error"]
    assert "frontend.port" in err and f"127.0.0.1:{port} is already in use" in err
    assert not d.find("child_started")  # failed before any engine core (model load) started


def test_an_unreadable_chat_template_exits_2_before_any_child(start_daemon, tmp_path):
    missing = tmp_path / "nowhere.jinja"
    d = start_daemon({"model": {"chat_template": str(missing)}})
    assert d.wait_exit(20) == 2
    assert f"model.chat_template: cannot read {str(missing)!r}" in d.find("startup_failed")[0]["error"]
    assert not d.find("child_started")


def test_a_kv_budget_beyond_the_hosts_memory_exits_2_before_any_child(start_daemon):
    """The real `pkgd serve` (which used to load the model for ~25 s, then exit 1 from the engine
    core): the budget alone cannot fit in this host's memory, so it is a config mistake, exit 2 at once."""
    gib = max(1024, 2 * (host.mem_total_bytes() or 0) >> 30)  # 1T, or twice the host's memory where that is more
    d = start_daemon({"cache": {"kv_cache_memory_bytes": f"{gib}G"}, "parallel": {"device": "cpu"}}, real=True)
    assert d.wait_exit(20) == 2
    err = d.find("startup_failed")[0]["error"]
    assert err.startswith(f"cache.kv_cache_memory_bytes: {gib}.0 GiB of KV cache is more than this host's ")
    assert "GiB of memory (MemTotal, " in err
    assert not d.find("child_started")


def test_runtime_dir_of_a_running_daemon_is_refused(start_daemon):
    first = start_daemon()
    first.wait_ready()
    second = start_daemon({"supervisor": {"runtime_dir": str(first.runtime_dir)}})
    assert second.wait_exit(20) == 2
    assert "in use by another pkgd" in second.find("startup_failed")[0]["error"]
    assert first.get("/health").status_code == 200
    assert (first.runtime_dir / "control.sock").exists()  # the refused one touched nothing
    assert first.status()["state"] == "running"  # control socket still there


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the link away")
def test_a_runtime_dir_through_another_users_symlink_exits_2_and_touches_nothing(start_daemon, workdir):
    victim = workdir / "victim"
    (victim / "run").mkdir(mode=0o755, parents=True)
    opened = workdir / "open"
    opened.mkdir(mode=0o1777)
    (opened / "evil").symlink_to(victim)
    os.chown(opened, 65534, 65534)
    os.lchown(opened / "evil", 65534, 65534)
    d = start_daemon({"supervisor": {"runtime_dir": str(opened / "evil" / "run")}})
    assert d.wait_exit(20) == 2
    err = d.find("startup_failed")[0]["error"]
    assert f"supervisor.runtime_dir: {opened / 'evil' / 'run'}: {opened / 'evil'} is a symbolic link" in err
    assert not d.find("child_started")
    assert stat.S_IMODE((victim / "run").stat().st_mode) == 0o755 and not list((victim / "run").iterdir())


def test_sigterm_during_engine_load_exits_within_2s(start_daemon):
    d = start_daemon({"model": {"source": "fake:load=60"}})
    engine = d.wait_event("child_started")["child_pid"]
    time.sleep(0.5)
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait_exit(10) == 0
    assert time.monotonic() - t0 < 2.0
    assert not pid_alive(engine)
    assert not [line for line in d.lines if "never retrieved" in line]


def test_no_secret_outlives_a_kill_9_of_the_supervisor(start_daemon):
    """The children get the configuration over pipes: after kill -9 of the supervisor (its
    children die with it) no file under the runtime directory holds the API key."""
    d = start_daemon({"frontend": {"api_keys": ["sk-kill9-secret"]}})
    d.wait_ready()
    pids = d.all_child_pids()
    d.proc.kill()
    d.wait_exit(10)
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)]
    leaked = [p for p in d.runtime_dir.rglob("*") if p.is_file() and b"sk-kill9-secret" in p.read_bytes()]
    assert leaked == []


def test_engine_that_fails_to_start_exits_1_with_its_message(start_daemon):
    d = start_daemon({"model": {"source": "fake:fail=weights not found at /nowhere"}})
    assert d.wait_exit(20) == 1
    assert "weights not found at /nowhere" in d.find("startup_failed")[0]["error"]
    assert not d.find("ready")


def test_drain_lets_inflight_requests_finish_and_refuses_new_ones(start_daemon):
    d = start_daemon({"supervisor": {"drain_timeout": 5}})
    url = d.wait_ready()
    api = d.child_pids("api-server")["api-server-0"]
    result: dict[str, object] = {}

    def slow() -> None:
        result["response"] = httpx.get(url + "/slow?s=1.5", timeout=10)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)  # the request is in flight
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        refused = httpx.get(url + "/health", timeout=2).status_code != 200
    except httpx.HTTPError:
        refused = True
    assert refused  # stopped accepting
    t.join(10)
    assert result["response"].status_code == 200  # the in-flight request finished
    assert result["response"].json()["pid"] == api
    assert d.wait_exit(20) == 0
    assert time.monotonic() - t0 >= 0.9  # it waited for the drain, not cut it short


def test_children_die_with_a_killed_supervisor(start_daemon):
    d = start_daemon({"parallel": {"dp": 2}})
    d.wait_ready()
    pids = d.all_child_pids()
    d.signal(signal.SIGKILL)  # no chance to stop anything: PR_SET_PDEATHSIG must do it
    d.wait_exit(10)
    deadline = time.monotonic() + 5
    while [p for p in pids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)]


def test_second_sigterm_kills_without_waiting_for_the_drain(start_daemon):
    d = start_daemon({"supervisor": {"drain_timeout": 30}})
    url = d.wait_ready()

    def slow() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut off by the kill, as it should be
            httpx.get(url + "/slow?s=20", timeout=30)

    t = threading.Thread(target=slow, daemon=True)
    t.start()
    time.sleep(0.5)
    d.signal(signal.SIGTERM)
    time.sleep(1.0)
    assert d.proc.poll() is None  # draining the 20 s request
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.wait_exit(10) == 0
    assert time.monotonic() - t0 < 3
    assert not [p for p in d.all_child_pids() if pid_alive(p)]
