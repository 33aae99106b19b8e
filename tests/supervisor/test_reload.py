"""SIGHUP reload: rejected, live, rolling API restart, engine swap — real processes under load."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from pydantic import ValidationError
from supervisor_helpers import Load, pid_alive, reload_and_wait

from pkgd.cli.ctl import format_status
from pkgd.config.vllm_config import VllmConfig
from pkgd.supervisor.reload import config_problems


def test_problems_of_a_validation_error_name_the_dotted_path():
    with pytest.raises(ValidationError) as info:
        VllmConfig.model_validate({"parallel": {"tp": 0}})
    assert config_problems(info.value) == ["parallel.tp: Input should be greater than or equal to 1"]


def test_broken_file_keeps_serving_and_says_why(start_daemon, notify_socket):
    d = start_daemon(env={"NOTIFY_SOCKET": str(notify_socket.path)})
    d.wait_ready()
    pids = d.child_pids()
    mark = len(notify_socket.messages)
    outcome = reload_and_wait(d, {"parallel": {"tp": 0}, "scheduler": {"max_num_seqs": -1}})
    assert outcome["event"] == "reload_rejected"
    problems = {e["problem"] for e in d.find("reload_rejected")}
    assert {p.split(":")[0] for p in problems} == {"parallel.tp", "scheduler.max_num_seqs"}  # every problem logged
    ready = notify_socket.wait_for("READY", "1", after=mark)
    assert "last reload rejected" in ready["STATUS"] and "parallel.tp" in ready["STATUS"]
    assert d.child_pids() == pids and d.get("/generate").status_code == 200
    assert d.get("/whoami").json()["model_name"] is None  # the children kept their configuration


def test_live_change_applies_in_place(start_daemon):
    d = start_daemon({"model": {"name": "before"}})
    d.wait_ready()
    pids = d.child_pids()
    assert reload_and_wait(d, {"model": {"name": "after"}, "logging": {"level": "debug"}})["event"] == "reload_applied"
    assert d.child_pids() == pids  # nothing restarted
    assert d.get("/whoami").json()["model_name"] == "after"  # sent on the API server's config pipe
    assert not list(d.runtime_dir.glob("*.json"))  # no secrets file on disk


def test_restart_class_change_is_refused(start_daemon):
    d = start_daemon()
    d.wait_ready()
    outcome = reload_and_wait(d, {"supervisor": {"runtime_dir": str(d.workdir / "elsewhere")}})
    assert outcome["event"] == "reload_rejected" and "supervisor.runtime_dir" in outcome["problem"]


@pytest.mark.parametrize("keepalive", [False, True])
def test_frontend_change_rolls_api_servers_without_a_failed_request(start_daemon, keepalive):
    d = start_daemon()
    url = d.wait_ready()
    before = d.child_pids()
    load = Load(url, clients=4, keepalive=keepalive)
    time.sleep(0.5)
    outcome = reload_and_wait(d, {"frontend": {"api_server_count": 2}})
    time.sleep(0.5)
    load.stop()
    assert outcome["event"] == "reload_applied" and outcome["reload_class"] == "api"
    assert load.failures == [] and load.ok > 20
    after = d.child_pids()
    assert after["engine-core-0"] == before["engine-core-0"]  # engine untouched
    assert set(after) == {"engine-core-0", "api-server-0", "api-server-1"}
    assert before["api-server-0"] not in after.values()
    deadline = time.monotonic() + 10
    while pid_alive(before["api-server-0"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(before["api-server-0"])  # the old one drained and left
    assert d.status()["api_generation"] == 1


@pytest.mark.parametrize("reload_class", ["api", "engine"])
def test_a_replaced_generation_keeps_its_requests_past_drain_timeout(start_daemon, reload_class):
    """drain_timeout (1 s here) bounds a shutdown only: a request of 4 s on the replaced API
    server ends normally, the drain key changed by the same reload reaches the old generation,
    and ``pkgd status`` lists the draining generation with the request it holds."""
    d = start_daemon({"supervisor": {"drain_timeout": 1}, "model": {"source": "fake:load=0.2"}})
    url = d.wait_ready()
    before = d.child_pids()
    answer: dict = {}
    # 8 s: the old generation must still hold it 1.5 s after the reload, which takes seconds on a loaded host
    slow = threading.Thread(target=lambda: answer.update(r=httpx.get(url + "/slow?s=8", timeout=30)))
    slow.start()
    time.sleep(0.5)
    change = {"frontend": {"api_server_count": 2}} if reload_class == "api" else {"model": {"source": "fake:load=0.3"}}
    outcome = reload_and_wait(d, {**change, "supervisor": {"drain_timeout": 1, "reload_drain_timeout": 300}})
    assert outcome["event"] == "reload_applied" and outcome["reload_class"] == reload_class
    time.sleep(1.5)  # past drain_timeout + its grace would have been: 1 + 0.5 s
    status = d.status()
    draining = status["draining"]
    assert [g["generation"] for g in draining] == [0] and draining[0]["connections"] == 1, draining
    assert "draining generation 0: 1 connection(s)" in format_status(status) and "of 300 s" in format_status(status)
    assert pid_alive(before["api-server-0"])
    slow.join(30)
    assert answer["r"].status_code == 200, answer["r"].text
    assert answer["r"].json() == {"pid": before["api-server-0"], "slept": 8.0, "reload_drain_timeout": 300.0}
    d.wait_event("generation_retired", timeout=15, generation=0)
    assert not pid_alive(before["api-server-0"]) and d.status()["draining"] == []
    if reload_class == "engine":
        assert not pid_alive(before["engine-core-0"])  # stopped once its API servers left


@pytest.mark.parametrize("swap", ["overlap", "stop_first"])
def test_engine_change_swaps_cores_without_a_failed_request(start_daemon, swap):
    d = start_daemon({"parallel": {"dp": 2}, "supervisor": {"engine_swap": swap}, "model": {"source": "fake:load=0.3"}})
    url = d.wait_ready()
    before = d.child_pids()
    load = Load(url, clients=4)
    time.sleep(0.5)
    outcome = reload_and_wait(d, {"model": {"source": "fake:load=0.5"}})
    time.sleep(0.5)
    load.stop()
    assert outcome["event"] == "reload_applied" and outcome["reload_class"] == "engine"
    assert d.find("engine_swap")[0]["strategy"] == swap
    assert load.failures == [] and load.ok > 10
    after = d.child_pids()
    assert not set(before.values()) & set(after.values())  # every child replaced
    served = {d.get("/generate").json()["engine_pid"] for _ in range(6)}
    assert served == {after["engine-core-0"], after["engine-core-1"]}  # the new cores answer
    assert "engine-1-0.sock" in d.get("/whoami").json()["engines"][0]  # generation 1 addresses
    assert d.status()["generation"] == 1
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in before.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in before.values() if pid_alive(p)]


def test_engine_change_that_fails_keeps_the_old_cores(start_daemon):
    d = start_daemon({"supervisor": {"engine_swap": "overlap"}})
    d.wait_ready()
    before = d.child_pids()
    outcome = reload_and_wait(d, {"model": {"source": "fake:fail=no such model"}})
    assert outcome["event"] == "reload_failed" and "no such model" in outcome["problem"]
    assert d.child_pids() == before and d.get("/generate").status_code == 200


def test_a_child_restarted_during_an_engine_swap_gets_its_own_generation_config(start_daemon):
    """While generation 1 (a new model) loads, an API server of generation 0 crashes: its
    restart serves generation 0's configuration, not the tree being swapped in."""
    d = start_daemon({"model": {"name": "old"}, "supervisor": {"engine_swap": "overlap", "restart_backoff": 0.1}})
    d.wait_ready()
    mark = d.mark()
    d.write_config({**d.config, "model": {"name": "new", "source": "fake:load=4"}})
    d.signal(signal.SIGHUP)
    d.wait_event("engine_swap", after=mark)
    os.kill(d.child_pids()["api-server-0"], signal.SIGKILL)
    d.wait_event("child_restarted", after=mark, child="api-server-0")
    assert not d.find("reload_applied")  # generation 1 is still loading
    assert d.get("/whoami").json()["model_name"] == "old"
    d.wait_event("reload_applied", timeout=30, after=mark)
    assert d.get("/whoami").json()["model_name"] == "new"


def test_stop_first_failure_starts_the_previous_config_again(start_daemon):
    d = start_daemon({"supervisor": {"engine_swap": "stop_first"}})
    d.wait_ready()
    outcome = reload_and_wait(d, {"model": {"source": "fake:fail=no such model"}})
    assert outcome["event"] == "reload_failed"
    assert d.get("/generate").status_code == 200
    assert d.status()["state"] == "running"


def test_port_change_moves_to_the_new_socket(start_daemon):
    d = start_daemon()
    old_url = d.wait_ready()
    outcome = reload_and_wait(d, {"frontend": {"host": "127.0.0.2"}})
    assert outcome["event"] == "reload_applied"
    new_url = d.status()["urls"][0]
    assert new_url.startswith("http://127.0.0.2:")
    assert d.get("/generate", url=new_url).status_code == 200
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # the old port is closed
        d.get("/health", url=old_url, timeout=2)


def test_swap_strategy_auto_follows_memory_and_mode(monkeypatch):
    from types import SimpleNamespace

    from pkgd.supervisor import reload as rl

    def sup(plan_mode="single"):
        engines = {0: SimpleNamespace(pid=os.getpid())}
        return SimpleNamespace(plan=SimpleNamespace(mode=plan_mode), fleet=SimpleNamespace(engines=engines))

    cpu = VllmConfig.model_validate({"parallel": {"device": "cpu"}})
    assert rl.can_overlap(sup(), cpu, cpu.serve_plan())[0]  # this test process is small
    monkeypatch.setattr(rl.host, "mem_available_bytes", lambda: 1)
    ok, why = rl.can_overlap(sup(), cpu, cpu.serve_plan())
    assert not ok and "GiB available" in why
    forced = VllmConfig.model_validate({"parallel": {"device": "cpu"}, "supervisor": {"engine_swap": "overlap"}})
    assert rl.can_overlap(sup(), forced, forced.serve_plan())[0]
    cuda = VllmConfig.model_validate({"parallel": {"device": "cuda"}})
    assert not rl.can_overlap(sup(), cuda, cuda.serve_plan())[0]
    headless = VllmConfig.model_validate({"frontend": {"headless": True}, "supervisor": {"engine_swap": "overlap"}})
    assert rl.can_overlap(sup(), headless, headless.serve_plan()) == (
        False,
        "headless engine cores keep their TCP addresses",
    )
