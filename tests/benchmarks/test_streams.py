"""`pkgd.benchmarks.streams`: outcomes name the connection a request went on, even when the
server closed it without a response (the fault suite tells killed-process requests by it);
each way a stream can end is its own kind (``ok`` only with the full token count and
``[DONE]``); clients of a mixed workload each send their own body on their own kept-alive
connection."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from pkgd.benchmarks.streams import Outcome, StreamClients, mixed_bodies, summarize


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


class _SSEHandler(http.server.BaseHTTPRequestHandler):
    """Answers ``/v1/completions`` as the body's ``scenario`` says (see `SCENARIOS`), on
    keep-alive HTTP/1.1 connections; records each request's peer port."""

    protocol_version = "HTTP/1.1"
    peers: list[int] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.peers.append(self.client_address[1])
        scenario, n = body.get("scenario", "ok"), body["max_tokens"]
        if scenario == "http_503":
            data = b'{"error": {"message": "no engine core"}}'
            self.send_response(503)
            self.send_header("content-type", "application/json")
            self.send_header("retry-after", "0")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        tokens = [{"choices": [{"index": 0, "text": "x"}]}] * (n if scenario != "process_exit" else 2)
        usage = {"choices": [], "usage": {"completion_tokens": n - 1 if scenario == "short" else n}}
        events: list[object] = {
            "ok": [*tokens, usage, "[DONE]"],
            "slow": [*tokens, usage, "[DONE]"],  # 10 ms an event
            "short": [*tokens, usage, "[DONE]"],
            "no_usage": [*tokens, "[DONE]"],
            "error_event": [*tokens[:1], {"error": {"message": "shutting down", "type": "x"}}, "[DONE]"],
            "no_done": [*tokens, usage],  # the body ends cleanly without [DONE]
            "error_no_done": [*tokens[:1], {"error": {"message": "boom"}}],
            "process_exit": tokens,  # then the connection drops mid-body
            "malformed": [*tokens[:1], "{not json"],
            "hang": tokens[:1],
        }[scenario]
        for e in events:
            line = e if isinstance(e, str) else json.dumps(e)
            self._chunk(f"data: {line}\n\n".encode())
            if scenario == "slow":
                time.sleep(0.01)
        if scenario == "hang":
            time.sleep(1.0)
        if scenario in ("process_exit", "hang", "malformed"):
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


@pytest.fixture
def sse_server():
    class Handler(_SSEHandler):
        peers: list[int] = []

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:  # a client that went away (cancel)
            pass

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", Handler.peers
    server.shutdown()
    server.server_close()


def _first(url: str, scenario: str, **kw) -> Outcome:
    load = StreamClients(url, 1, body={"scenario": scenario, "max_tokens": 5}, **kw)
    deadline = time.monotonic() + 10
    while not load.counts() and time.monotonic() < deadline:
        time.sleep(0.01)
    return load.stop(timeout=10)[0]


@pytest.mark.parametrize(
    ("scenario", "kind", "done"),
    [
        ("ok", "ok", True),
        ("short", "short", True),
        ("no_usage", "short", True),
        ("error_event", "error_event", True),
        ("no_done", "cut", False),
        ("error_no_done", "cut", False),
        ("process_exit", "cut", False),
        ("malformed", "cut", False),
        ("http_503", "http_503", False),
    ],
)
def test_each_ending_of_a_stream_is_classified(sse_server, scenario, kind, done):
    url, _ = sse_server
    o = _first(url, scenario)
    assert (o.kind, o.done) == (kind, done), o
    assert o.max_tokens == 5 and o.client == 0
    if kind == "ok":
        assert o.tokens == 5 and not o.detail
    if scenario == "short":
        assert o.tokens == 4 and "4 of 5" in o.detail
    if scenario == "error_event":
        assert o.detail == "shutting down"
    if scenario == "error_no_done":
        assert "boom" in o.detail and "without [DONE]" in o.detail
    if scenario == "http_503":
        assert o.retry_after == "0"


def test_a_stream_without_a_byte_for_read_timeout_is_a_hang(sse_server):
    url, _ = sse_server
    o = _first(url, "hang", read_timeout=0.3)
    assert (o.kind, o.done) == ("hang", False), o
    assert "after 1 events" in o.detail


def test_mixed_bodies_keep_alive_clients_each_ask_their_own_max_tokens(sse_server):
    url, peers = sse_server
    load = StreamClients(url, 4, bodies=mixed_bodies(4, 1, 40, 3))
    load.wait_for(12, timeout=10)
    outcomes = load.stop(timeout=10)
    assert {o.kind for o in outcomes} == {"ok"}
    assert {(o.client, o.max_tokens, o.tokens) for o in outcomes} == {(0, 40, 40), (1, 3, 3), (2, 3, 3), (3, 3, 3)}
    for client in range(4):  # one kept-alive connection each, request after request
        mine = [o for o in outcomes if o.client == client]
        assert len({o.port for o in mine}) == 1, mine
    assert len(set(peers)) == 4 and len(peers) == len(outcomes)


def test_mixed_bodies_and_bodies_are_checked():
    assert mixed_bodies(3, 1, 100, 10) == [{"max_tokens": 100}, {"max_tokens": 10}, {"max_tokens": 10}]
    with pytest.raises(ValueError):
        mixed_bodies(3, 4, 100, 10)
    with pytest.raises(ValueError):
        StreamClients("http://127.0.0.1:9", 2, bodies=[{}])


def test_wait_started_names_the_client_that_began_a_request(sse_server):
    url, _ = sse_server
    load = StreamClients(url, 2, bodies=mixed_bodies(2, 1, 400, 1))
    try:
        t = time.monotonic()
        assert load.wait_started([0], after=t, timeout=10) == 0
    finally:
        load.stop(timeout=10)


def test_stop_with_cancel_abandons_a_running_stream_as_cancelled(sse_server):
    url, _ = sse_server
    load = StreamClients(url, 1, body={"scenario": "slow", "max_tokens": 1000})  # 10 s
    load.wait_started([0], after=0.0, timeout=10)
    time.sleep(0.2)
    t = time.monotonic()
    outcomes = load.stop(timeout=10, cancel=True)
    assert time.monotonic() - t < 2.0
    assert [(o.kind, o.done) for o in outcomes] == [("cancelled", False)], outcomes
    assert summarize(outcomes)["sent"] == 0 and summarize(outcomes)["failed"] == 0


def test_summarize_counts_truncated_and_done():
    def o(kind: str, done: bool, retry_after: str | None = None) -> Outcome:
        return Outcome(kind, 0.0, 1.0, retry_after=retry_after, done=done)

    s = summarize(
        [
            o("ok", True),
            o("short", True),
            o("cut", False),
            o("error_event", True),
            o("http_503", False, "2"),
            o("refused", False),
        ]
    )
    assert s == {
        "sent": 5,
        "ok": 1,
        "failed": 3,
        "unavailable": 1,
        "truncated": 2,
        "done": 3,
        "kinds": {"ok": 1, "short": 1, "cut": 1, "error_event": 1, "http_503": 1, "refused": 1},
    }
