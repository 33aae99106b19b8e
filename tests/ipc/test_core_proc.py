"""The engine-core loop (`EngineCoreProc`) over a real ROUTER socket, driven by raw DEALER
clients speaking the wire protocol; the core is the deterministic fake."""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq

from pkgd.engine.core_proc import EngineCoreProc
from pkgd.ipc import child, transport
from pkgd.ipc.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    EngineCoreRequest,
    EngineError,
    EngineOutputs,
    FinishReason,
    Handshake,
    Hello,
    Shutdown,
    decode_engine,
    encode,
)
from pkgd.sampling_params import SamplingParams

from .fake_engine import CRASH_TOKEN, MAX_MODEL_LEN, FakeEngineCore


def req(rid: str, prompt=(5, 6, 7), max_tokens: int = 3, **kw) -> AddRequest:
    sp = SamplingParams(max_tokens=max_tokens, **kw)
    return AddRequest(
        request=EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, eos_token_id=0)
    )


class Served:
    """An EngineCoreProc running in a thread over ipc://, plus helpers for raw clients."""

    def __init__(self, tmp_path, core=None) -> None:
        self.ctx = zmq.Context()
        self.address = transport.ipc_address(tmp_path, 0)
        self.core = core or FakeEngineCore()
        self.sock = transport.bind_router(self.ctx, self.address)
        self.proc = EngineCoreProc(self.core, self.sock, 0)
        self.signals = child.SignalState()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.proc.run(self.signals)
        except BaseException as exc:
            self.error = exc

    def client(self, name: str) -> zmq.Socket:
        return transport.connect_dealer(self.ctx, self.address, name.encode())

    def stop(self) -> None:
        self.signals.request_stop()
        self.thread.join(5)
        if self.thread.is_alive():
            import sys
            import traceback

            traceback.print_stack(sys._current_frames()[self.thread.ident])
        assert not self.thread.is_alive()


def recv(sock: zmq.Socket, timeout_ms: int = 3000):
    """The next frame that is not a stats-only broadcast."""
    while True:
        assert sock.poll(timeout_ms), "no frame from the engine core"
        msg = decode_engine(sock.recv())
        if not (isinstance(msg, EngineOutputs) and not msg.outputs):
            return msg


def recv_outputs(sock: zmq.Socket, until_finished: set[str]) -> dict[str, list]:
    """Collect tokens per request until every id in ``until_finished`` finished."""
    tokens: dict[str, list] = {}
    reasons: dict[str, FinishReason] = {}
    while not until_finished <= reasons.keys():
        msg = recv(sock)
        assert isinstance(msg, EngineOutputs), msg
        for out in msg.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    return {rid: (tokens.get(rid, []), reasons.get(rid)) for rid in tokens}


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path)
    yield s
    s.stop()
    s.ctx.destroy(linger=0)


def hello(sock: zmq.Socket) -> Handshake:
    sock.send(encode(Hello(version=PROTOCOL_VERSION, client_id="t")))
    hs = recv(sock)
    assert isinstance(hs, Handshake)
    return hs


def test_every_frame_round_trips_through_msgpack():
    frames = [Hello(version=1, client_id="c"), req("a", logprobs=2), AbortRequests(request_ids=["a"]), Shutdown()]
    from pkgd.ipc.messages import decode_client

    for frame in frames:
        assert decode_client(encode(frame)) == frame
    err = EngineError(engine_index=1, message="m", request_ids=["x"], rejected=True)
    assert decode_engine(encode(err)) == err
    with pytest.raises(msgspec.DecodeError):
        decode_client(b"\x93garbage")


def test_hello_gets_handshake_then_outputs_follow_the_token_rule(served):
    c = served.client("a")
    hs = hello(c)
    assert (hs.version, hs.engine_index, hs.max_model_len, hs.model_name) == (
        PROTOCOL_VERSION,
        0,
        MAX_MODEL_LEN,
        "fake-model",
    )
    c.send(encode(req("r1", prompt=(5, 6, 7), max_tokens=3)))
    got = recv_outputs(c, {"r1"})
    assert got["r1"] == ([8, 9, 10], FinishReason.LENGTH)


def test_each_client_gets_only_its_own_requests(served):
    a, b = served.client("a"), served.client("b")
    hello(a), hello(b)
    a.send(encode(req("ra", prompt=(1,), max_tokens=4)))
    b.send(encode(req("rb", prompt=(100,), max_tokens=2)))
    assert recv_outputs(a, {"ra"}) == {"ra": ([2, 3, 4, 5], FinishReason.LENGTH)}
    assert recv_outputs(b, {"rb"}) == {"rb": ([101, 102], FinishReason.LENGTH)}


def test_version_mismatch_is_refused(served):
    c = served.client("old")
    c.send(encode(Hello(version=PROTOCOL_VERSION + 1, client_id="old")))
    msg = recv(c)
    assert isinstance(msg, EngineError) and "protocol version" in msg.message
    c.send(encode(req("r")))  # not handshaken: refused, not run
    msg = recv(c)
    assert isinstance(msg, EngineError) and msg.request_ids == ["r"] and not msg.rejected
    assert "r" not in served.core.requests


def test_invalid_request_is_rejected_and_the_core_keeps_serving(served):
    c = served.client("a")
    hello(c)
    c.send(encode(req("big", prompt=range(1, 200), max_tokens=100)))
    msg = recv(c)
    assert isinstance(msg, EngineError) and msg.rejected and msg.request_ids == ["big"]
    assert "max_model_len" in msg.message
    c.send(encode(req("ok", max_tokens=1)))
    assert recv_outputs(c, {"ok"})["ok"][1] == FinishReason.LENGTH


def test_abort_stops_a_request(served):
    served.core.step_seconds = 0.02
    c = served.client("a")
    hello(c)
    c.send(encode(req("long", max_tokens=200)))
    first = recv(c)
    assert isinstance(first, EngineOutputs)
    c.send(encode(AbortRequests(request_ids=["long", "unknown"])))
    served.thread.join(0.3)
    assert served.core.aborted == ["long"] and not served.core.requests


def test_stats_reach_every_client_and_show_the_engine_idle_at_the_end(served):
    a, b = served.client("a"), served.client("b")
    hello(a), hello(b)
    a.send(encode(req("r", max_tokens=2)))
    recv_outputs(a, {"r"})
    last = None
    while b.poll(1500):
        msg = decode_engine(b.recv())
        assert isinstance(msg, EngineOutputs) and msg.outputs == []
        last = msg.scheduler_stats
    assert last is not None and last.num_running_reqs == 0


def test_a_vanished_client_has_its_requests_aborted(served):
    served.core.step_seconds = 0.02
    c = served.client("gone")
    hello(c)
    c.send(encode(req("orphan", max_tokens=240)))
    recv(c)
    c.close(linger=0)
    served.thread.join(1.0)
    assert served.core.aborted == ["orphan"]


def test_shutdown_frame_aborts_everything_and_tells_the_clients(served):
    served.core.step_seconds = 0.02
    c = served.client("a")
    hello(c)
    c.send(encode(req("r", max_tokens=240)))
    recv(c)
    c.send(encode(Shutdown()))
    served.thread.join(3)
    assert not served.thread.is_alive()
    msgs = []
    while c.poll(500):
        msgs.append(decode_engine(c.recv()))
    errors = [m for m in msgs if isinstance(m, EngineError)]
    assert errors and errors[-1].request_ids == ["r"] and "shutting down" in errors[-1].message


def test_a_crashing_step_fails_every_request_with_an_error(served):
    served.core.step_seconds = 0.01
    c = served.client("a")
    hello(c)
    c.send(encode(req("ok", max_tokens=240)))
    c.send(encode(req("boom", prompt=(CRASH_TOKEN, 1))))
    served.thread.join(3)
    assert isinstance(served.error, RuntimeError)
    failed = set()
    while c.poll(500):
        msg = decode_engine(c.recv())
        if isinstance(msg, EngineError):
            failed |= set(msg.request_ids)
            assert "failed" in msg.message
    assert failed == {"ok", "boom"}
