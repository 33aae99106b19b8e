"""Serve modes: which children and sockets each mode gets, checked on real processes."""

from __future__ import annotations

import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
from supervisor_helpers import HARNESS, free_port_pair

from pkgd.config.vllm_config import VllmConfig
from pkgd.supervisor.runtime import RuntimeDir
from pkgd.supervisor.sockets import BindError, Listener, ListenSpec, listen_specs
from pkgd.supervisor.topology import Entrypoints, api_specs, engine_specs


def plan_children(cfg: dict):
    config = VllmConfig.model_validate(cfg)
    plan = config.serve_plan()
    runtime = RuntimeDir(Path("/run/x"))
    specs = listen_specs(config, plan)
    listeners = [Listener(s, socket.socket(), f"http://h:{8000 + i}") for i, s in enumerate(specs)]
    engines = engine_specs(config, plan, runtime, 0, Entrypoints(), {})
    apis = api_specs(config, plan, runtime, listeners, {e.index: e.address for e in engines}, 0, Entrypoints(), {})
    for listener in listeners:
        listener.sock.close()
    return plan, specs, engines, apis


def engine_args(api) -> list[str]:
    argv = list(api.argv)
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--engine-address"]


def test_internal_lb_every_api_server_talks_to_every_core():
    plan, specs, engines, apis = plan_children({"parallel": {"dp": 2}})
    assert plan.mode == "multi_api" and specs == [ListenSpec("127.0.0.1", 8000, None)]
    assert [e.address for e in engines] == ["ipc:///run/x/engine-0-0.sock", "ipc:///run/x/engine-0-1.sock"]
    assert len(apis) == 2 and all(engine_args(a) == [e.address for e in engines] for a in apis)


def test_external_lb_one_endpoint_and_core_per_rank():
    plan, specs, engines, apis = plan_children({"parallel": {"dp": 2}, "lb": {"mode": "external"}})
    assert plan.mode == "external_lb"
    assert [(s.port, s.rank) for s in specs] == [(8000, 0), (8001, 1)]
    assert [engine_args(a) for a in apis] == [[engines[0].address], [engines[1].address]]
    assert [a.address for a in apis] == ["http://h:8000", "http://h:8001"]


def test_hybrid_lb_uses_node_local_cores_only():
    cfg = {"parallel": {"dp": 4, "nnodes": 2, "node_rank": 1, "dp_local": 2}, "lb": {"mode": "hybrid"}}
    plan, specs, engines, apis = plan_children(cfg)
    assert plan.mode == "hybrid_lb" and [e.index for e in engines] == [2, 3]
    assert len(apis) == 2 and all(engine_args(a) == [e.address for e in engines] for a in apis)


def test_headless_binds_tcp_and_remote_engines_join_the_api_servers():
    plan, specs, engines, apis = plan_children(
        {"frontend": {"headless": True}, "parallel": {"dp": 2, "dp_rpc_port": 20000}}
    )
    assert plan.mode == "headless" and specs == [] and apis == []
    assert [e.address for e in engines] == ["tcp://127.0.0.1:20000", "tcp://127.0.0.1:20001"]
    _, _, engines, apis = plan_children({"parallel": {"remote_engines": ["tcp://10.0.0.2:20000"]}})
    assert engine_args(apis[0]) == [engines[0].address, "tcp://10.0.0.2:20000"]


def test_uds_with_external_lb_is_refused():
    config = VllmConfig.model_validate(
        {"parallel": {"dp": 2}, "lb": {"mode": "external"}, "frontend": {"uds": "/tmp/x.sock"}}
    )
    with pytest.raises(BindError, match="frontend.uds cannot be used with lb.mode: external"):
        listen_specs(config, config.serve_plan())


# ---- real processes -----------------------------------------------------------------


def test_multi_api_both_servers_answer_on_one_socket(start_daemon):
    d = start_daemon({"frontend": {"api_server_count": 2}})
    d.wait_ready()
    pids = {d.get("/whoami").json()["pid"] for _ in range(40)}
    assert pids == set(d.child_pids("api-server").values())


def test_data_parallel_api_server_reaches_both_cores(start_daemon):
    d = start_daemon({"parallel": {"dp": 2}, "frontend": {"api_server_count": 1}})
    d.wait_ready()
    served = {d.get("/generate").json()["engine_index"] for _ in range(4)}
    assert served == {0, 1}


def test_external_lb_each_rank_on_port_plus_rank(start_daemon):
    port = free_port_pair()
    d = start_daemon({"parallel": {"dp": 2}, "lb": {"mode": "external"}, "frontend": {"port": port}})
    d.wait_ready()
    urls = d.status()["urls"]
    assert urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    for rank, url in enumerate(urls):
        assert {d.get("/generate", url=url).json()["engine_index"] for _ in range(3)} == {rank}
    health = wait_health(d, 2)
    assert [h["healthy"] for h in health] == [True, True]  # the supervisor probes every rank


def test_headless_instance_serves_another_instances_api_servers(start_daemon):
    rpc = free_port_pair()
    common = {"parallel": {"dp": 2, "nnodes": 2, "dp_rpc_port": rpc}}
    headless = start_daemon(
        {**common, "parallel": {**common["parallel"], "node_rank": 1}, "frontend": {"headless": True}}, name="headless"
    )
    event = headless.wait_event("ready")
    assert event["url"] is None and event["engines"] == [f"tcp://127.0.0.1:{rpc + 1}"]
    api = start_daemon(
        {"parallel": {**common["parallel"], "remote_engines": [f"tcp://127.0.0.1:{rpc + 1}"]}}, name="api"
    )
    api.wait_ready()
    served = {api.get("/generate").json()["engine_pid"] for _ in range(4)}
    assert served == {api.child_pids()["engine-core-0"], headless.child_pids()["engine-core-1"]}
    headless.signal(signal.SIGTERM)
    assert headless.wait_exit(20) == 0


@pytest.mark.skipif(not shutil.which("systemd-socket-activate"), reason="needs systemd-socket-activate")
def test_systemd_socket_activation_is_adopted(start_daemon, workdir):
    port = free_port_pair()
    cfg_dir = workdir / "sa"
    d = start_daemon(
        name="sa",
        argv=[
            "systemd-socket-activate",
            "-l",
            f"127.0.0.1:{port}",
            sys.executable,
            str(HARNESS),
            str(cfg_dir / "pkgd.yaml"),
        ],
    )
    assert d.config_path == cfg_dir / "pkgd.yaml"
    # systemd-socket-activate starts the service on the first connection, as systemd would;
    # connect once it listens.
    deadline = time.monotonic() + 20
    while not any(line.startswith("Listening on") for line in d.lines) and time.monotonic() < deadline:
        time.sleep(0.02)
    first = httpx.get(f"http://127.0.0.1:{port}/generate", timeout=30)
    assert first.status_code == 200  # the connection queued on the passed socket was served
    assert d.wait_ready() == f"http://127.0.0.1:{port}"
    assert d.status()["pid"] == d.proc.pid  # socket-activate exec()s the daemon


def wait_health(d, n: int) -> list[dict]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        health = d.status()["health"]
        if len(health) == n and all(h["status"] is not None for h in health):
            return health
        time.sleep(0.2)
    raise AssertionError(d.status()["health"])
