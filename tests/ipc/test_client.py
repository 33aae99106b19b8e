"""`EngineClient` against real engine-core processes (the `core_proc` loop serving the
deterministic fake core), started the way the supervisor starts them."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pkgd.ipc import transport
from pkgd.ipc.client import EngineClient, EngineRequestError, EngineUnavailableError
from pkgd.ipc.messages import ChildFailed, EngineCoreRequest, EngineOutputs, Handshake
from pkgd.sampling_params import SamplingParams

from .launch import spawn_engine, write_config


class Sink:
    """Collects tokens and errors per request id."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.errors: dict[str, EngineRequestError] = {}
        self.engine_of: dict[str, int] = {}
        self.event = asyncio.Event()

    def on_outputs(self, msg: EngineOutputs) -> None:
        for out in msg.outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            self.engine_of[out.request_id] = msg.engine_index
            if out.finish_reason is not None:
                self.finished[out.request_id] = str(out.finish_reason)
        self.event.set()

    def on_request_error(self, request_ids, error) -> None:
        for rid in request_ids:
            self.errors[rid] = error
        self.event.set()

    async def wait_for(self, ids, timeout: float = 10.0) -> None:
        async def done():
            while not all(i in self.finished or i in self.errors for i in ids):
                self.event.clear()
                await self.event.wait()

        await asyncio.wait_for(done(), timeout)


def request(rid: str, prompt=(10,), max_tokens: int = 4) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(max_tokens=max_tokens)
    )


@pytest.fixture
def runtime(tmp_path):
    return tmp_path, write_config(tmp_path)


@pytest.fixture
def engines(runtime):
    tmp, cfg = runtime
    started = []

    def start(index: int = 0, env: dict | None = None):
        e = spawn_engine(cfg, transport.ipc_address(tmp, index), index, env=env)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


def test_engine_reports_its_handshake_on_the_ready_pipe(engines):
    e = engines(0)
    hs = e.wait_ready(30)
    assert isinstance(hs, Handshake) and hs.engine_index == 0 and hs.pid == e.proc.pid and hs.model_name == "fake-model"


def test_requests_flow_through_a_real_core_process(engines, runtime):
    engines(0).wait_ready(30)

    async def main():
        sink = Sink()
        client = EngineClient([transport.ipc_address(runtime[0], 0)], sink)
        assert await client.start(10)
        assert client.is_available() and client.handshake.max_model_len == 256
        client.add_requests([request("a", (10,), 4), request("b", (20,), 2)])
        await sink.wait_for(["a", "b"])
        assert sink.tokens == {"a": [11, 12, 13, 14], "b": [21, 22]}
        assert sink.finished == {"a": "length", "b": "length"}
        assert client.num_inflight() == 0
        client.add_requests([request("big", range(1, 250), 50)])
        await sink.wait_for(["big"])
        assert sink.errors["big"].rejected
        await client.close()

    asyncio.run(main())


def test_a_large_step_is_delivered_in_chunks_that_let_the_loop_run(engines, runtime):
    """One step's outputs for 100 requests reach the sink in chunks of OUTPUT_CHUNK, with
    other tasks of the event loop running between them."""
    from pkgd.ipc.client import OUTPUT_CHUNK

    engines(0, env={"FAKE_STEP_SECONDS": "0.3"}).wait_ready(30)  # requests pile up into one step

    async def main():
        ticks = 0
        calls: list[tuple[int, int]] = []
        sink = Sink()
        on_outputs = sink.on_outputs

        def recording(msg):
            calls.append((len(msg.outputs), ticks))
            on_outputs(msg)

        sink.on_outputs = recording

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick = asyncio.ensure_future(ticker())
        client = EngineClient([transport.ipc_address(runtime[0], 0)], sink)
        assert await client.start(10)
        ids = [f"r{i}" for i in range(100)]
        for rid in ids:
            client.add_requests([request(rid, (10,), 3)])
        await sink.wait_for(ids)
        tick.cancel()
        await client.close()
        assert max(n for n, _ in calls) <= OUTPUT_CHUNK
        assert any(a[0] == OUTPUT_CHUNK and b[1] > a[1] for a, b in zip(calls, calls[1:])), calls

    asyncio.run(main())


def test_new_requests_go_to_the_least_loaded_core(engines, runtime):
    tmp = runtime[0]
    for i in (0, 1):
        engines(i, env={"FAKE_STEP_SECONDS": "0.05"}).wait_ready(30)
    addrs = [transport.ipc_address(tmp, i) for i in (0, 1)]

    async def main():
        sink, other_sink = Sink(), Sink()
        client = EngineClient(addrs, sink)
        other = EngineClient(addrs[:1], other_sink)  # another API server, loading core 0 only
        assert await client.start(10) and await other.start(10)
        other.add_requests([request(f"o{i}", (1,), 200) for i in range(6)])
        # core 0's stats reach `client` within a stats interval; it should then prefer core 1
        await asyncio.sleep(0.5)
        engines_used = [client.add_requests([request(f"c{i}", (1,), 100)]) for i in range(4)]
        assert engines_used.count(1) >= 3, engines_used
        client.abort_requests([f"c{i}" for i in range(4)])
        other.abort_requests([f"o{i}" for i in range(6)])
        await client.close()
        await other.close()

    asyncio.run(main())


def test_killed_core_fails_inflight_requests_then_recovers_when_restarted(engines, runtime):
    tmp = runtime[0]
    e = engines(0, env={"FAKE_STEP_SECONDS": "0.05"})
    e.wait_ready(30)

    async def main():
        sink = Sink()
        client = EngineClient([transport.ipc_address(tmp, 0)], sink)
        assert await client.start(10)
        client.add_requests([request("r", (1,), 200)])
        await asyncio.sleep(0.3)
        assert client.engine_stats()[0].num_running_reqs == 1
        t0 = time.monotonic()
        os.kill(e.proc.pid, signal.SIGKILL)
        await sink.wait_for(["r"], timeout=10)
        assert "disconnected" in str(sink.errors["r"]) and not sink.errors["r"].rejected
        assert time.monotonic() - t0 < 3
        assert not client.is_available()
        assert client.engine_stats()[0].num_running_reqs == 0  # the dead core's last stats are gone
        with pytest.raises(EngineUnavailableError):
            client.add_requests([request("x")])
        engines(0).wait_ready(30)  # the supervisor restarts it at the same address
        for _ in range(100):
            if client.is_available():
                break
            await asyncio.sleep(0.05)
        assert client.is_available()
        client.add_requests([request("after", (30,), 2)])
        await sink.wait_for(["after"])
        assert sink.tokens["after"] == [31, 32]
        await client.close()

    asyncio.run(main())


def test_sigterm_aborts_requests_with_an_error_and_exits_0(engines, runtime):
    tmp = runtime[0]
    e = engines(0, env={"FAKE_STEP_SECONDS": "0.05"})
    e.wait_ready(30)

    async def main():
        sink = Sink()
        client = EngineClient([transport.ipc_address(tmp, 0)], sink)
        assert await client.start(10)
        client.add_requests([request("r", (1,), 200)])
        await asyncio.sleep(0.3)
        e.proc.send_signal(signal.SIGTERM)
        await sink.wait_for(["r"], timeout=5)
        assert "shutting down" in str(sink.errors["r"])
        await client.close()

    asyncio.run(main())
    assert e.proc.wait(5) == 0


def test_sigterm_while_loading_exits_within_2_seconds(engines):
    e = engines(0, env={"FAKE_LOAD_SECONDS": "60"})
    time.sleep(1.0)  # past interpreter start-up, inside the load
    t0 = time.monotonic()
    e.proc.send_signal(signal.SIGTERM)
    assert e.proc.wait(5) == 0
    assert time.monotonic() - t0 < 2


def test_bind_failure_is_reported_as_child_failed(runtime):
    tmp, cfg = runtime
    e = spawn_engine(cfg, f"ipc://{tmp}/missing-dir/engine-0.sock")
    msg = e.wait_ready(30)
    assert isinstance(msg, ChildFailed) and "cannot bind" in msg.message and msg.role == "engine-core"
    assert e.proc.wait(10) == 1


def test_unreadable_config_is_reported_as_child_failed(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model": {"dtype": "float8"}}')
    e = spawn_engine(bad, transport.ipc_address(tmp_path, 0))
    msg = e.wait_ready(30)
    assert isinstance(msg, ChildFailed) and "model.dtype" in msg.message.replace("\n", " ") or "dtype" in msg.message
    assert e.proc.wait(10) == 1


def test_cores_are_reachable_over_tcp(engines, runtime):
    import socket

    tmp, cfg = runtime
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    e = spawn_engine(cfg, address, 0)
    try:
        assert isinstance(e.wait_ready(30), Handshake)

        async def main():
            sink = Sink()
            client = EngineClient([address], sink)
            assert await client.start(10)
            client.add_requests([request("t", (40,), 3)])
            await sink.wait_for(["t"])
            assert sink.tokens["t"] == [41, 42, 43]
            await client.close()

        asyncio.run(main())
    finally:
        e.stop()


def test_an_engine_still_loading_is_no_warning(tmp_path, capsys):
    """A cold start takes longer than the client's first wait: that is logged at info, not
    as a warning (the caller's own deadline, supervisor.engine_ready_timeout, is the fault)."""
    from pkgd import log
    from pkgd.config.sections import LoggingConfig

    log.configure(LoggingConfig(format="json"), role="test")

    async def main():
        client = EngineClient([transport.ipc_address(tmp_path, 0)], Sink())  # nothing there yet
        assert not await client.start(0.2)
        await client.close()

    asyncio.run(main())
    err = capsys.readouterr().err
    assert "engine_handshake_timeout" not in err and '"level": "warning"' not in err


def test_utility_calls_reach_every_core_and_carry_refusals(engines, runtime):
    tmp = runtime[0]
    for i in (0, 1):
        engines(i, env={"FAKE_STEP_SECONDS": "0.05"}).wait_ready(30)

    async def main():
        sink = Sink()
        client = EngineClient([transport.ipc_address(tmp, i) for i in (0, 1)], sink)
        assert await client.start(10)
        results = await client.call_utility("reset_prefix_cache")
        assert sorted(r.engine_index for r in results) == [0, 1] and all(r.result is True for r in results)
        client.add_requests([request("long", (10,), 40)])
        busy = await client.call_utility("sleep", {"level": 1})
        assert sorted(r.error_status for r in busy) == [0, 409]  # the core running "long" refuses
        bad = await client.call_utility("sleep", {"lvl": 1})
        assert all(r.error_status == 400 and r.error for r in bad)
        assert [r.result for r in await client.call_utility("is_sleeping")].count(True) == 1
        await sink.wait_for(["long"])
        await client.close()

    asyncio.run(main())
