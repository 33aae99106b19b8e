"""`pkgd.benchmarks.streams`: outcomes name the connection a request went on, even when the
server closed it without a response (the fault suite tells killed-process requests by it)."""

from __future__ import annotations

import socket
import threading
import time

from pkgd.benchmarks.streams import StreamClients


def _server_that_hangs_up() -> tuple[socket.socket, list[int]]:
    """A listener that reads one request per connection and closes it without answering."""
    sock = socket.create_server(("127.0.0.1", 0))
    peers: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, addr = sock.accept()
            except OSError:
                return
            peers.append(addr[1])
            conn.recv(65536)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return sock, peers


def test_a_request_answered_by_a_hang_up_is_cut_with_its_connections_port():
    sock, peers = _server_that_hangs_up()
    try:
        load = StreamClients(f"http://127.0.0.1:{sock.getsockname()[1]}", 1, stop_on=("cut",))
        deadline = time.monotonic() + 10
        while not load.counts() and time.monotonic() < deadline:  # its client stops at the cut
            time.sleep(0.01)
        outcomes = load.stop(timeout=10)
    finally:
        sock.close()
    assert [o.kind for o in outcomes] == ["cut"], outcomes
    assert outcomes[0].port is not None and outcomes[0].port in peers
