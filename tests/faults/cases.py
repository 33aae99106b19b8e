"""The fault cases, shared by the fault suite and ``benchmarks/fault_table.py``.

Each case runs `StreamClients` (32 streaming clients on keep-alive connections) against a real
daemon (`supervisor_helpers.Daemon`), makes one fault happen while the streams flow, lets the
load run on for a moment, and returns what every request came to (`Case`). The checks of what
must hold are the test suite's; the benchmark prints the figures.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from supervisor_helpers import Daemon, reload_and_wait

from pkgd.benchmarks.streams import Outcome, StreamClients, summarize
from pkgd.config.sections import DEFAULT_MODEL_SOURCE

CLIENTS = 32
SETTLE_S = 1.0  # load kept running after the fault


@dataclasses.dataclass
class Case:
    name: str
    outcomes: list[Outcome]
    recovery_s: float | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def summary(self) -> dict[str, Any]:
        return summarize(self.outcomes)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind not in ("ok", "refused", "cancelled")]


def fault_config(model: Path) -> dict:
    """The daemon of the cases: two API servers, one engine core, ``model`` with SmolLM2's tokenizer."""
    return {
        "model": {"source": str(model), "tokenizer": DEFAULT_MODEL_SOURCE, "name": "tiny", "max_model_len": 256},
        "cache": {"num_blocks": 512},
        "frontend": {"api_server_count": 2},
        "parallel": {"cpu_threads": 1},
        # Generous deadlines: on a loaded 2-core host a start of the engine core took 30 s.
        "supervisor": {
            "drain_timeout": 60,
            "restart_backoff": 0.2,
            "engine_swap": "overlap",
            "engine_ready_timeout": 600,
        },
    }


def _load(d: Daemon, **kw: Any) -> StreamClients:
    load = StreamClients(d.url, CLIENTS, read_timeout=120, **kw)
    load.wait_for(CLIENTS, timeout=60)
    return load


def _finish(load: StreamClients) -> list[Outcome]:
    load.wait_for(CLIENTS, timeout=300)  # flowing again
    time.sleep(SETTLE_S)
    return load.stop()


def frontend_reload(d: Daemon, value: float) -> Case:
    """(a) A frontend change: API servers replaced by a rolling restart on the held socket."""
    load = _load(d)
    before = set(d.child_pids("api-server").values())
    outcome = reload_and_wait(d, {"frontend": {"keep_alive_timeout": value}}, timeout=600)
    assert outcome["event"] == "reload_applied" and outcome["reload_class"] == "api", outcome
    outcomes = _finish(load)
    return Case("frontend reload", outcomes, info={"replaced": before - set(d.child_pids("api-server").values())})


def engine_reload(d: Daemon, value: int) -> Case:
    """(b) An engine change: a whole new generation of engine core and API servers, swapped in."""
    load = _load(d)
    before = set(d.child_pids().values())
    outcome = reload_and_wait(d, {"scheduler": {"max_num_seqs": value}}, timeout=900)
    assert outcome["event"] == "reload_applied" and outcome["reload_class"] == "engine", outcome
    outcomes = _finish(load)
    return Case("engine reload", outcomes, info={"replaced": before - set(d.child_pids().values())})


def kill_api_server(d: Daemon) -> Case:
    """(d) kill -9 of one of two API servers; which requests were on it is read from /proc."""
    load = _load(d)
    pids = d.child_pids("api-server")
    victim, survivor = pids["api-server-1"], pids["api-server-0"]
    port = int(d.url.rsplit(":", 1)[1])
    os.kill(victim, signal.SIGSTOP)  # freeze its connections while they are listed
    _wait_stopped(victim)  # kill() returns before a busy process stops: it could still accept
    on_victim, on_survivor = client_ports(victim, port), client_ports(survivor, port)
    mark = d.mark()
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    restarted = d.wait_event("child_restarted", timeout=600, after=mark, child="api-server-1")
    outcomes = _finish(load)
    return Case(
        "kill -9 API server",
        outcomes,
        _since(killed_at, restarted),
        {"on_victim": on_victim, "on_survivor": on_survivor, "killed_at": killed_at},
    )


def kill_engine_core(d: Daemon) -> Case:
    """(e) kill -9 of the engine core: its streams end with an error event, new requests get
    503 until it is back."""
    load = _load(d)
    engine = d.child_pids("engine-core")["engine-core-0"]
    inflight = len(load.inflight_snapshot())
    mark = d.mark()
    killed_at, killed_mono = time.time(), time.monotonic()
    os.kill(engine, signal.SIGKILL)
    restarted = d.wait_event("child_restarted", timeout=600, after=mark, child="engine-core-0")
    recovered_mono = time.monotonic()
    outcomes = _finish(load)
    return Case(
        "kill -9 engine core",
        outcomes,
        _since(killed_at, restarted),
        {"inflight": inflight, "killed_mono": killed_mono, "recovered_mono": recovered_mono},
    )


def sigterm(d: Daemon) -> Case:
    """(c) SIGTERM drain: streams in flight finish, new connections are refused."""
    load = StreamClients(d.url, CLIENTS, read_timeout=120, stop_on=("refused",))
    load.wait_for(CLIENTS, timeout=60)
    inflight = len(load.inflight_snapshot())
    stopped_at = time.monotonic()
    d.signal(signal.SIGTERM)
    rc = d.wait_exit(600)
    outcomes = load.stop()
    return Case("SIGTERM drain", outcomes, time.monotonic() - stopped_at, {"exit_code": rc, "inflight": inflight})


def _since(wall: float, event: dict[str, Any]) -> float:
    return round(datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp() - wall, 2)


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is stopped (state ``T`` in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just ended
                continue
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout} s of SIGSTOP")


def client_ports(pid: int, server_port: int) -> set[int]:
    """Remote (client) ports of the TCP connections process ``pid`` holds on ``server_port``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if inode in inodes and int(local.rsplit(":", 1)[1], 16) == server_port:
                ports.add(int(remote.rsplit(":", 1)[1], 16))
    ports.discard(0)  # the listening socket
    return ports
