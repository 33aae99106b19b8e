"""sd_notify: the datagrams a real NOTIFY_SOCKET listener receives."""

from __future__ import annotations

import os
import signal
import socket
import time

from pkgd.supervisor.notify import Notifier


def test_abstract_namespace_address_receives_the_datagram():
    name = f"pkgd-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(b"\0" + name.encode())
        listener.settimeout(2)
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready("serving\nnext line")
        assert listener.recv(4096) == b"READY=1\nSTATUS=serving next line"


def test_without_notify_socket_nothing_is_sent_and_watchdog_needs_our_pid():
    n = Notifier.from_env({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())})
    assert not n.enabled and not n.ready("x")
    assert n.watchdog_interval == 1.0  # half of WATCHDOG_USEC
    assert Notifier.from_env({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}).watchdog_interval is None


def test_ready_watchdog_reloading_stopping_sequence(start_daemon, notify_socket):
    d = start_daemon(env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "400000"})
    d.wait_ready()
    ready = notify_socket.wait_for("READY", "1")
    assert "single" in ready["STATUS"] and d.url in ready["STATUS"]
    notify_socket.wait_for("WATCHDOG", "1")
    t0 = time.monotonic()
    time.sleep(1.0)
    pings = [t for t, m in notify_socket.messages if "WATCHDOG" in m and t > t0]
    assert 3 <= len(pings) <= 7  # every 0.2 s (half of 0.4 s)

    mark = len(notify_socket.messages)
    before_us = time.monotonic_ns() // 1000
    d.signal(signal.SIGHUP)
    reloading = notify_socket.wait_for("RELOADING", "1", after=mark)
    assert before_us <= int(reloading["MONOTONIC_USEC"]) <= time.monotonic_ns() // 1000
    notify_socket.wait_for("READY", "1", after=mark)

    mark = len(notify_socket.messages)
    d.signal(signal.SIGTERM)
    notify_socket.wait_for("STOPPING", "1", after=mark)
    assert d.wait_exit(20) == 0


def test_children_do_not_inherit_systemd_variables(start_daemon, notify_socket):
    d = start_daemon(env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "5000000"})
    d.wait_ready()
    for name, pid in d.child_pids().items():
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        assert not [v for v in env if v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_USEC=", b"LISTEN_FDS="))]
        metrics = f"PROMETHEUS_MULTIPROC_DIR={d.runtime_dir}/metrics-0".encode()
        assert (metrics in env) == name.startswith("api-server")


def test_watchdog_stops_while_an_endpoint_hangs_and_resumes_after(start_daemon, notify_socket):
    d = start_daemon(env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "600000"})
    d.wait_ready()
    notify_socket.wait_for("WATCHDOG", "1")
    api = d.child_pids()["api-server-0"]
    mark = d.mark()
    os.kill(api, signal.SIGSTOP)  # alive, "ready", but answering nothing: hung
    try:
        d.wait_event("watchdog_withheld", after=mark, timeout=15)
        t0 = time.monotonic()
        time.sleep(1.0)
        assert not [t for t, m in notify_socket.messages if "WATCHDOG" in m and t > t0]
    finally:
        os.kill(api, signal.SIGCONT)
    t1 = time.monotonic()
    deadline = t1 + 10
    while not [t for t, m in notify_socket.messages if "WATCHDOG" in m and t > t1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [t for t, m in notify_socket.messages if "WATCHDOG" in m and t > t1]
    assert d.child_pids()["api-server-0"] == api  # the watchdog is systemd's call, not a restart


def test_status_line_tells_of_a_restarting_child(start_daemon, notify_socket):
    d = start_daemon(
        {"supervisor": {"restart_backoff": 3.0}},
        env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "400000"},
    )
    d.wait_ready()
    notify_socket.wait_for("READY", "1")
    mark = len(notify_socket.messages)
    os.kill(d.child_pids()["engine-core-0"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any("restarting engine-core-0" in m.get("STATUS", "") for _, m in notify_socket.messages[mark:]):
            break
        time.sleep(0.05)
    else:
        raise AssertionError([m for _, m in notify_socket.messages[mark:] if "STATUS" in m])
    d.wait_event("child_restarted")
