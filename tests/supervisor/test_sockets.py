"""Listening sockets: bind errors name the key, Unix sockets, systemd's LISTEN_FDS."""

from __future__ import annotations

import os
import socket

import pytest

from pkgd.supervisor.sockets import BindError, ListenSpec, adopt, bind, open_listeners, systemd_fds


def test_port_zero_reports_the_real_port():
    listener = bind(ListenSpec("127.0.0.1", 0, None))
    try:
        port = listener.sock.getsockname()[1]
        assert listener.url == f"http://127.0.0.1:{port}" and port > 0
        assert not listener.sock.get_inheritable()  # children get it through pass_fds only
    finally:
        listener.close()


def test_port_in_use_and_foreign_address_are_clear_errors():
    first = bind(ListenSpec("127.0.0.1", 0, None))
    port = first.sock.getsockname()[1]
    try:
        with pytest.raises(BindError, match=rf"frontend.port: 127.0.0.1:{port} is already in use"):
            bind(ListenSpec("127.0.0.1", port, None))
        with pytest.raises(BindError, match=r"frontend.port \(\+ DP rank 1\)"):
            bind(ListenSpec("127.0.0.1", port, None, rank=1))
    finally:
        first.close()
    with pytest.raises(BindError, match="frontend.host: 192.0.2.1 is not an address of this machine"):
        bind(ListenSpec("192.0.2.1", 0, None))
    with pytest.raises(BindError, match="frontend.host: cannot resolve"):
        bind(ListenSpec("no-such-host.invalid", 0, None))


def test_all_or_nothing_when_a_later_bind_fails():
    busy = bind(ListenSpec("127.0.0.1", 0, None))
    port = busy.sock.getsockname()[1]
    try:
        free = ListenSpec("127.0.0.1", 0, None, rank=0)
        with pytest.raises(BindError):
            open_listeners([free, ListenSpec("127.0.0.1", port, None, rank=1)], environ={})
    finally:
        busy.close()


def test_unix_socket_replaces_a_stale_file_and_refuses_a_live_one(tmp_path):
    path = str(tmp_path / "api.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # file left behind, nobody listening
    listener = bind(ListenSpec("127.0.0.1", 8000, path))
    assert listener.url == f"unix:{path}"
    with pytest.raises(BindError, match="is in use by a running server"):
        bind(ListenSpec("127.0.0.1", 8000, path))
    listener.close()
    assert not os.path.exists(path)
    (tmp_path / "plain").write_text("x")
    with pytest.raises(BindError, match="exists and is not a socket"):
        bind(ListenSpec("127.0.0.1", 8000, str(tmp_path / "plain")))


def test_systemd_fds_only_for_this_pid_and_count_must_match():
    assert systemd_fds({"LISTEN_PID": "1", "LISTEN_FDS": "2"}) == []
    assert systemd_fds({"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "2"}) == [3, 4]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    fd = os.dup(sock.fileno())
    sock.close()
    with pytest.raises(BindError, match="passed 1 listening socket"):
        adopt([ListenSpec("h", 1, None, 0), ListenSpec("h", 2, None, 1)], [fd])
    [listener] = adopt([ListenSpec("h", 1, None)], [fd])
    assert listener.from_systemd and listener.url.startswith("http://127.0.0.1:")
    listener.close()


def test_refuse_new_connections_drops_syns_keeps_open_connections_then_refuses(tmp_path):
    """After `refuse_new_connections` a new connect gets no answer while the socket is open
    (its SYN is dropped, so the accept queue stops growing), an open connection still carries
    data both ways, and once the socket closes the waiting client is refused, not reset."""
    import threading
    import time

    from pkgd.supervisor.sockets import refuse_new_connections

    listener = bind(ListenSpec("127.0.0.1", 0, None))
    port = listener.sock.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    served, _ = listener.sock.accept()
    listener.refuse_new_connections()
    client.sendall(b"ping")
    assert served.recv(4) == b"ping"
    served.sendall(b"pong")
    assert client.recv(4) == b"pong"

    late = socket.socket()
    late.settimeout(0.3)
    with pytest.raises(TimeoutError):
        late.connect(("127.0.0.1", port))  # no SYN-ACK: the SYN was dropped
    late.close()

    outcome: list[str] = []

    def connect() -> None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            outcome.append("connected")
        except OSError as exc:
            outcome.append(type(exc).__name__)

    waiting = threading.Thread(target=connect)
    waiting.start()
    time.sleep(0.2)
    listener.close()
    waiting.join(10)
    assert outcome == ["ConnectionRefusedError"]  # its retransmitted SYN found the port closed
    client.close()
    served.close()

    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(tmp_path / "s"))
    unix.listen()
    assert refuse_new_connections(unix) is False  # not TCP: nothing to filter
    unix.close()


def test_a_socket_from_systemd_keeps_taking_connections(monkeypatch):
    """systemd queues connections on its socket while pkgd is down (and starts pkgd on them):
    pkgd's stop must not make that socket drop SYNs."""
    held = bind(ListenSpec("127.0.0.1", 0, None))
    (adopted,) = adopt([held.spec], [os.dup(held.fileno())])
    adopted.refuse_new_connections()
    adopted.close()
    socket.create_connection(("127.0.0.1", held.sock.getsockname()[1]), timeout=2).close()
    held.close()
