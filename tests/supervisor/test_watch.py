"""supervisor.watch_config: a real supervisor (fake children) composing a system tree whose
conf.d is a ConfigMap volume, updated the kubelet's way (tests/configmap.py)."""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path

import openai
import pytest
import yaml
from supervisor_helpers import BASE_CONFIG, HARNESS, merge
from tests.configmap import write_configmap

WATCH = {"supervisor": {"watch_config": True, "watch_debounce": 0.2}, "logging": {"level": "debug"}}


def start_watched(start_daemon, workdir: Path, main: dict, conf_d: dict[str, dict], name: str = "w"):
    """A daemon on system tree ``workdir/etc-NAME``: ``pkgd.yaml`` = BASE + ``main``, conf.d a
    ConfigMap holding ``conf_d`` (key → values)."""
    etc = workdir / f"etc-{name}"
    etc.mkdir()
    runtime = workdir / name / "run"  # where start_daemon's Daemon looks for the control socket
    (etc / "pkgd.yaml").write_text(
        yaml.safe_dump(merge(BASE_CONFIG, merge({"supervisor": {"runtime_dir": str(runtime)}}, main)))
    )
    update(etc, conf_d, "2026_12_06_00_00_00.000000001")
    d = start_daemon(argv=[sys.executable, str(HARNESS), "--config-dir", str(etc)], name=name)
    d.wait_ready()
    return d, etc


def update(etc: Path, conf_d: dict[str, dict], stamp: str) -> None:
    write_configmap(etc / "conf.d", {k: yaml.safe_dump(v) for k, v in conf_d.items()}, stamp)


def test_configmap_swap_reloads_and_a_bad_one_is_rejected_while_serving(start_daemon, workdir):
    d, etc = start_watched(start_daemon, workdir, WATCH, {"10-model.yaml": {"model": {"name": "before"}}})
    started = d.wait_event("config_watch_started")
    assert started["paths"] == [str(etc)] and started["files"] == ["conf.d/10-model.yaml", "pkgd.yaml"]
    pids, digest = d.child_pids(), d.status()["config_hash"]

    mark = d.mark()
    update(etc, {"10-model.yaml": {"model": {"name": "after"}}}, "2026_12_06_00_01_00.000000001")
    assert d.wait_event("config_changed", after=mark)["files"] == ["conf.d/10-model.yaml"]
    applied = d.wait_event("reload_applied", after=mark)
    assert applied["reload_class"] == "live" and applied["changed"] == ["model.name"]
    assert d.get("/whoami").json()["model_name"] == "after"  # the live key reached the API server
    status = d.status()
    assert status["config_hash"] != digest and status["last_reload"]["result"] == "applied"
    assert d.child_pids() == pids
    assert len(d.find("config_changed")) == len(d.find("reload_started")) == 1  # the kubelet's burst: one reload

    mark = d.mark()
    update(etc, {"10-model.yaml": {"model": {"name": "bad"}, "parallel": {"tp": 0}}}, "2026_12_06_00_02_00.000000001")
    rejected = d.wait_event("reload_rejected", after=mark)
    assert rejected["problem"].startswith("parallel.tp")
    assert d.get("/generate").status_code == 200 and d.get("/whoami").json()["model_name"] == "after"
    assert d.status()["last_reload"]["result"] == "rejected" and d.child_pids() == pids

    mark = d.mark()  # the fix reloads: the rejected tree did not stop the watch
    update(etc, {"10-model.yaml": {"model": {"name": "fixed"}}}, "2026_12_06_00_03_00.000000001")
    d.wait_event("reload_applied", after=mark)
    assert d.get("/whoami").json()["model_name"] == "fixed"


def test_api_class_change_by_configmap_starts_a_new_generation(start_daemon, workdir):
    d, etc = start_watched(
        start_daemon, workdir, WATCH, {"10-api.yaml": {"frontend": {"limits": {"max_n": 8}}}}, name="g"
    )
    d.wait_event("config_watch_started")
    generation = d.status()["generation"]
    mark = d.mark()
    update(
        etc, {"10-api.yaml": {"frontend": {"limits": {"max_n": 8}}, "logging": {"http_server_level": "error"}}}, "s2"
    )
    assert d.wait_event("reload_applied", after=mark)["reload_class"] == "api"
    assert d.status()["generation"] > generation


def test_churn_beside_the_config_does_not_reload(start_daemon, workdir):
    d, etc = start_watched(start_daemon, workdir, WATCH, {"10-model.yaml": {"model": {"name": "same"}}}, name="c")
    d.wait_event("config_watch_started")
    mark = d.mark()
    (etc / "conf.d" / ".10-model.yaml.swp").write_text("editor state")
    (etc / "README.txt").write_text("notes")
    (etc / "pkgd.yaml").touch()
    update(etc, {"10-model.yaml": {"model": {"name": "same"}}}, "same-content")  # a resync writing equal data
    d.wait_event("config_watch_unchanged", after=mark)  # the watcher saw the events and compared
    assert not d.find("config_changed") and not d.find("reload_started")
    assert d.status()["last_reload"] is None
    d.signal(signal.SIGTERM)  # the watch ends with the daemon
    assert d.wait_exit(30) == 0


def test_watch_config_is_a_live_key(start_daemon, workdir):
    off = {"logging": {"level": "debug"}, "supervisor": {"watch_debounce": 0.2}}
    d, etc = start_watched(start_daemon, workdir, off, {"10-model.yaml": {"model": {"name": "one"}}}, name="l")
    assert not d.find("config_watch_started")
    mark = d.mark()
    update(etc, {"10-model.yaml": {"model": {"name": "two"}}, "20-watch.yaml": WATCH}, "s2")
    d.signal(signal.SIGHUP)  # off: only SIGHUP reads the change, which turns the watch on
    assert d.wait_event("reload_applied", after=mark)["changed"] == [
        "model.name",
        "supervisor.watch_config",
    ]
    d.wait_event("config_watch_started", after=mark)
    mark = d.mark()
    update(etc, {"10-model.yaml": {"model": {"name": "three"}}}, "s3")  # also turns it off again
    assert d.wait_event("config_changed", after=mark)["files"] == ["conf.d/10-model.yaml", "conf.d/20-watch.yaml"]
    d.wait_event("reload_applied", after=mark)
    d.wait_event("config_watch_stopped", after=mark)
    assert d.get("/whoami").json()["model_name"] == "three"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pkgd.cli.serve") is None, reason="needs `pkgd serve`")
def test_real_pkgd_serve_follows_a_configmap_and_keeps_serving_a_bad_one(start_daemon):
    """`pkgd serve --config-dir` with SmolLM2: a conf.d ConfigMap appears, then changes, then
    turns invalid; the openai client sees the live key and is served throughout."""
    real = {
        "model": {"max_model_len": 1024},
        "cache": {"kv_cache_memory_bytes": 64 << 20},
        "supervisor": {"engine_ready_timeout": 300, "watch_config": True, "watch_debounce": 0.3},
    }
    d = start_daemon(real, real=True)
    url = d.wait_ready(300)
    etc = d.config_path.parent
    d.wait_event("config_watch_started", 60)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def chat(model: str) -> str:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=4
        )
        return r.choices[0].message.content or ""

    mark = d.mark()
    update(etc, {"10-names.yaml": {"frontend": {"served_model_names": ["smol-a"]}}}, "2026_12_06_01")
    assert d.wait_event("config_changed", 60, after=mark)["files"] == ["conf.d/10-names.yaml"]
    assert d.wait_event("reload_applied", 60, after=mark)["changed"] == ["frontend.served_model_names"]
    assert [m.id for m in client.models.list().data] == ["smol-a"] and chat("smol-a")

    mark = d.mark()
    update(etc, {"10-names.yaml": {"frontend": {"served_model_names": ["smol-b"], "portt": 1}}}, "2026_12_06_02")
    assert "frontend.portt" in d.wait_event("reload_rejected", 60, after=mark)["problem"]
    assert [m.id for m in client.models.list().data] == ["smol-a"] and chat("smol-a")
