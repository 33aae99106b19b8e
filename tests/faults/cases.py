"""The fault cases, shared by the fault suite and ``benchmarks/fault_table.py``.

Each case runs `StreamClients` (32 streaming clients on keep-alive connections) against a real
daemon (`supervisor_helpers.Daemon`), makes one fault happen while the streams flow, lets the
load run on for a moment, and returns what every request came to (`Case`). The checks of what
must hold are the test suite's; the benchmark prints the figures.

The long-stream cases (`long_stream_config`, a `Mix` of clients) run some streams that last
several times ``supervisor.drain_timeout`` beside short ones, all back to back on kept-alive
connections, through a reload (api class, engine class by overlap or stop_first) or a SIGTERM:
a reload must let the replaced generation finish every request it accepted (bounded by
``supervisor.reload_drain_timeout``, not ``drain_timeout``), so none may fail or end short; a
SIGTERM past ``drain_timeout`` must end each stream it cuts with an error event and ``[DONE]``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from supervisor_helpers import Daemon, merge, pid_alive, reload_and_wait

from pkgd.benchmarks.streams import Outcome, StreamClients, mixed_bodies, summarize
from pkgd.config.sections import DEFAULT_MODEL_SOURCE

CLIENTS = 32
SETTLE_S = 1.0  # load kept running after the fault

# Long streams. On the 2-core dev host the tiny model streamed 4,000 tokens in ~9 s (3.9-10.5 s)
# to each of 4 long clients beside 12 short ones, in ~6.5 s to each of 4 alone (after a SIGTERM
# the short ones are refused) and in ~2 s to one alone; 1,500 tokens in ~6 s (3.4-10 s) to each
# of 8 beside 24 short. So a long stream lasts 2-5x LONG_DRAIN_TIMEOUT, more while a new
# generation starts beside it.
LONG_DRAIN_TIMEOUT = 2.0  # s: supervisor.drain_timeout of the long-stream daemon
LONG_TOKENS = 4000
SHORT_TOKENS = 32
LONG_MAX_MODEL_LEN = 4096  # prompt (8 token ids) + LONG_TOKENS
OLD_GENERATION_TIMEOUT = 300.0  # s a replaced generation may take to drain and exit


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

    def long(self) -> list[Outcome]:
        """The long streams' outcomes (a `Mix` case; none otherwise)."""
        mix = self.info.get("mix")
        return [o for o in self.outcomes if mix is not None and o.client < mix.long]


@dataclasses.dataclass(frozen=True)
class Mix:
    """``clients`` streaming clients, the first ``long`` of them asking ``long_tokens`` a
    request, the rest ``short_tokens``; all keep-alive, back to back."""

    clients: int
    long: int
    long_tokens: int = LONG_TOKENS
    short_tokens: int = SHORT_TOKENS

    def start(self, d: Daemon) -> StreamClients:
        bodies = mixed_bodies(self.clients, self.long, self.long_tokens, self.short_tokens)
        # read timeout: a stop_first swap keeps requests in the listen backlog while the old
        # generation finishes and the new one starts (tens of seconds on a loaded host)
        load = StreamClients(d.url, self.clients, bodies=bodies, read_timeout=300)
        load.wait_for(self.clients, timeout=120)
        return load

    def __str__(self) -> str:
        return (
            f"{self.clients} clients: {self.long} x {self.long_tokens} tokens, "
            f"{self.clients - self.long} x {self.short_tokens}"
        )


BENCH_MIX = Mix(32, 8)
TEST_MIX = Mix(16, 4)


def build_fault_model(path: Path) -> None:
    """The cases' tiny random-weight Llama, with positions for `LONG_MAX_MODEL_LEN` (the same
    weights as the 256-position one: default RoPE has no position-sized parameter)."""
    from runner.tiny_models import build_tiny

    build_tiny("llama-plain", path, max_position_embeddings=LONG_MAX_MODEL_LEN)


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


def long_stream_config(model: Path) -> dict:
    """`fault_config` with a `LONG_DRAIN_TIMEOUT` s ``drain_timeout`` and room for the long
    streams (``max_model_len``, KV blocks for `BENCH_MIX` at once). ``reload_drain_timeout``
    is left to its default (600 s): the key comes with the reload rewrite, and a tree naming
    it is rejected before that."""
    return merge(
        fault_config(model),
        {
            "model": {"max_model_len": LONG_MAX_MODEL_LEN},
            "cache": {"num_blocks": 3072},  # 8 x 4,008 + 24 x 40 tokens in 16-token blocks: ~2,070
            "supervisor": {"drain_timeout": LONG_DRAIN_TIMEOUT},
        },
    )


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


def long_api_reload(d: Daemon, mix: Mix) -> Case:
    """A frontend (api-class) reload under long and short streams."""
    value = 7.0 if d.config["frontend"].get("keep_alive_timeout") == 6.0 else 6.0
    return _long_reload(d, mix, "api reload, long", {"frontend": {"keep_alive_timeout": value}}, "api")


def long_engine_reload(d: Daemon, mix: Mix, swap: str = "overlap") -> Case:
    """An engine-class reload (``supervisor.engine_swap``: ``swap``) under long and short streams."""
    value = 129 if d.config.get("scheduler", {}).get("max_num_seqs") == 128 else 128
    change = {"supervisor": {"engine_swap": swap}, "scheduler": {"max_num_seqs": value}}
    return _long_reload(d, mix, f"engine reload {swap}, long", change, "engine", stop_first=swap == "stop_first")


def _long_reload(d: Daemon, mix: Mix, name: str, change: dict, reload_class: str, stop_first: bool = False) -> Case:
    """Reload ``change`` (over the daemon's running config, which it becomes), wait until the
    replaced children have exited, then until every client has had more requests end ok, and
    stop the load (the new generation's streams still running are cancelled). ``drain_from``
    in the info: when the replaced generation began to drain (the reload's start with
    stop_first, else its end: the new generation ready)."""
    load = mix.start(d)
    before = d.child_pids()
    inflight = len(load.inflight_snapshot())
    reloaded_at = time.monotonic()
    outcome = reload_and_wait(d, change, timeout=900)  # written over d.config
    assert outcome["event"] == "reload_applied" and outcome["reload_class"] == reload_class, outcome
    d.config = merge(d.config, change)
    applied_at = time.monotonic()
    replaced = {name: pid for name, pid in before.items() if pid not in set(d.child_pids().values())}
    exited = _wait_gone(replaced.values(), OLD_GENERATION_TIMEOUT)
    gone_at = time.monotonic()
    load.wait_for(mix.clients, timeout=300)  # flowing on the new generation
    outcomes = load.stop(timeout=300, cancel=True)
    return Case(
        name,
        outcomes,
        info={
            "mix": mix,
            "replaced": replaced,
            "old_exited": exited,
            "inflight": inflight,
            "reload_s": round(applied_at - reloaded_at, 2),
            "old_drain_s": round(gone_at - applied_at, 2),
            "drain_from": reloaded_at if stop_first else applied_at,
        },
    )


def long_sigterm(d: Daemon, mix: Mix) -> Case:
    """SIGTERM just after a long stream began (it cannot end within ``drain_timeout``): what
    is still running at the deadline must end with an error event and ``[DONE]``."""
    load = mix.start(d)
    fresh = load.wait_started(range(mix.long), after=time.monotonic(), timeout=120)
    inflight = len(load.inflight_snapshot())
    stopped_at = time.monotonic()
    d.signal(signal.SIGTERM)
    rc = d.wait_exit(600)
    exited_at = time.monotonic()
    outcomes = load.stop(timeout=60)
    return Case(
        "SIGTERM, long",
        outcomes,
        exited_at - stopped_at,
        {"mix": mix, "exit_code": rc, "inflight": inflight, "fresh_long_client": fresh, "drain_from": stopped_at},
    )


def _wait_gone(pids: Any, timeout: float) -> bool:
    """Wait until none of ``pids`` is alive; False if some still are after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


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
