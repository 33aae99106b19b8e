"""``pkgd status`` / ``pkgd reload`` against a running supervisor, over its control socket."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
from pathlib import Path

from pkgd.cli.ctl import _accepts_connections, find_runtime_dir

PKGD = str(Path(sys.executable).with_name("pkgd"))


def ctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([PKGD, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_status_lists_children_pids_uptime_hash_and_mode(start_daemon):
    d = start_daemon({"frontend": {"api_server_count": 2}})
    d.wait_ready()
    r = ctl("status", "--runtime-dir", str(d.runtime_dir), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["status"]
    assert s["pid"] == d.proc.pid and s["state"] == "running" and s["mode"] == "multi_api"
    assert len(s["config_hash"]) == 12 and s["uptime_s"] >= 0
    roles = sorted((c["role"], c["index"]) for c in s["children"])
    assert roles == [("api-server", 0), ("api-server", 1), ("engine-core", 0)]
    assert {c["pid"] for c in s["children"]} == d.all_child_pids()
    # Found without --runtime-dir: supervisor.runtime_dir composed from the daemon's own layers.
    r = ctl("--config-dir", str(d.config_path.parent), "status", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"]["pid"] == d.proc.pid
    r = ctl(f"supervisor.runtime_dir={d.runtime_dir}", "status", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["status"]["pid"] == d.proc.pid, r.stderr
    text = ctl("status", "--runtime-dir", str(d.runtime_dir)).stdout
    assert f"pid {d.proc.pid}" in text and "multi_api" in text and s["config_hash"] in text
    assert all(str(c["pid"]) in text for c in s["children"])
    mode = stat.S_IMODE((d.runtime_dir / "control.sock").stat().st_mode)
    assert mode & 0o077 == 0 and stat.S_IMODE(d.runtime_dir.stat().st_mode) == 0o700


def test_reload_reports_the_outcome_and_the_hash_changes(start_daemon):
    d = start_daemon()
    d.wait_ready()
    before = d.status()["config_hash"]
    d.write_config({**d.config, "model": {"name": "renamed"}})
    r = ctl("reload", "--runtime-dir", str(d.runtime_dir), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    outcome = json.loads(r.stdout)
    assert outcome["result"] == "applied" and outcome["reload_class"] == "live"
    assert outcome["changed"] == ["model.name"]
    assert d.status()["config_hash"] != before

    d.write_config("frontend: [not, a, mapping")
    r = ctl("reload", "--runtime-dir", str(d.runtime_dir))
    assert r.returncode == 2 and "rejected" in r.stdout  # as docs/operations.md says


def test_an_engine_reload_to_a_missing_model_is_rejected_before_anything_stops(start_daemon):
    """A model.source that names nothing is refused as ``pkgd serve`` refuses it (exit 2),
    before the serving generation is touched: a stop_first swap used to drain it first."""
    d = start_daemon({"supervisor": {"engine_swap": "stop_first"}})
    d.wait_ready()
    pids = d.all_child_pids()
    d.write_config({**d.config, "model": {"source": str(d.workdir / "missing.gguf")}})
    r = ctl("reload", "--runtime-dir", str(d.runtime_dir))
    assert r.returncode == 2 and "rejected" in r.stdout and "model.source" in r.stdout, r.stdout + r.stderr
    assert d.all_child_pids() == pids and not d.find("generation_retired")


def test_no_daemon_is_a_clear_error(workdir):
    r = ctl("status", "--runtime-dir", str(workdir))
    assert r.returncode == 2 and "no pkgd daemon is listening" in r.stderr


def test_unknown_command_gets_an_error_reply(start_daemon):
    d = start_daemon()
    d.wait_ready()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(d.runtime_dir / "control.sock"))
        s.sendall(b'{"command": "explode"}\n')
        reply = json.loads(s.makefile().readline())
    assert reply == {"ok": False, "error": "unknown command 'explode'; known: reload, status"}
    assert d.status()["state"] == "running"


def test_runtime_dir_lookup_order(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    assert find_runtime_dir("/x", env) == Path("/x")
    assert find_runtime_dir(None, {**env, "PKGD_SUPERVISOR__RUNTIME_DIR": "/y"}) == Path("/y")
    assert find_runtime_dir(None, {**env, "RUNTIME_DIRECTORY": "/run/pkgd/a"}) == Path("/run/pkgd/a")
    from pkgd.supervisor.runtime import default_runtime_dir

    assert find_runtime_dir(None, env) == default_runtime_dir(env)  # $XDG_RUNTIME_DIR/pkgd, or /run/pkgd as root


def test_an_invalid_tree_reaches_no_daemon(start_daemon, tmp_path):
    """``pkgd reload --config-dir BAD`` must not fall back to the daemon at a default
    directory (it reloaded that one, printed "unchanged" and exited 0)."""
    d = start_daemon()
    d.wait_ready()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "pkgd.yaml").write_text("parallel: {tpp: 2}\n")
    for command in ("reload", "status"):
        r = ctl("--config-dir", str(bad), command, env={"RUNTIME_DIRECTORY": str(d.runtime_dir)})
        assert r.returncode == 2, r.stdout + r.stderr
        assert "parallel.tpp: unknown key" in r.stderr and "not sent" in r.stderr and "--runtime-dir" in r.stderr
    assert not d.find("reload_started") and not d.find("control_command")


def test_a_stale_control_socket_is_not_taken_for_a_live_daemon(tmp_path):
    path = tmp_path / "control.sock"
    with socket.socket(socket.AF_UNIX) as s:  # bound, then closed: the file a kill -9 leaves
        s.bind(str(path))
    assert path.exists() and not _accepts_connections(path)
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(live))
        s.listen()
        assert _accepts_connections(live)


def test_ctl_and_the_supervisor_stay_light():
    code = (
        "import sys, pkgd.cli.ctl, pkgd.supervisor.supervisor; print(sorted(m for m in ('torch', 'hydra', "
        "'transformers') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stderr  # the daemon's parent process never loads torch
