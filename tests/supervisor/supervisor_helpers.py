"""Helpers for tests that run a real supervisor process (with fake or real children).

`Daemon` starts ``harness.py`` (or ``pkgd serve``) on a YAML config in a short private
directory (Unix socket paths are limited to 107 bytes), collects its JSON log lines, and on
teardown kills whatever is left, so a failing test leaves no process behind. The fixtures
that create them are in conftest.py; a uniquely named module, so ``from supervisor_helpers
import ...`` never picks another directory's conftest.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pkgd.supervisor.control import send_command

HARNESS = Path(__file__).parent / "harness.py"

# Tests of the real `pkgd serve` with its real children skip where those modules are absent.
NEEDS_REAL_CHILDREN = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("pkgd.engine.core_proc", "pkgd.api.server", "pkgd.cli.serve")),
    reason="needs the real children and `pkgd serve`",
)

BASE_CONFIG: dict[str, Any] = {
    "frontend": {"port": 0},
    "supervisor": {"drain_timeout": 3, "restart_backoff": 0.2, "restart_backoff_max": 1.0, "engine_ready_timeout": 30},
    "logging": {"format": "json"},
}


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class Daemon:
    """One supervisor process and what it logged."""

    def __init__(
        self,
        workdir: Path,
        config: dict[str, Any],
        env: dict[str, str] | None = None,
        argv: list[str] | None = None,
        real: bool = False,
    ) -> None:
        self.workdir = workdir
        self.runtime_dir = workdir / "run"
        self.config_path = workdir / ("etc/pkgd.yaml" if real else "pkgd.yaml")
        self.config_path.parent.mkdir(exist_ok=True)
        self.config = merge(merge(BASE_CONFIG, {"supervisor": {"runtime_dir": str(self.runtime_dir)}}), config)
        self.write_config(self.config)
        if real:  # the real `pkgd serve` with the real children, on this config tree (argv: more flags)
            pkgd = str(Path(sys.executable).with_name("pkgd"))
            argv = [pkgd, "serve", "--config-dir", str(self.config_path.parent), *(argv or [])]
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._cond = threading.Condition()
        cmd = argv or [sys.executable, str(HARNESS), str(self.config_path)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
            pass_fds=(),
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._cond:
                self.lines.append(line)
                try:
                    event = json.loads(line)
                except ValueError:
                    event = None
                if isinstance(event, dict):
                    self.events.append(event)
                self._cond.notify_all()

    def write_config(self, config: dict[str, Any] | str) -> None:
        text = config if isinstance(config, str) else yaml.safe_dump(config)
        self.config_path.write_text(text)

    def find(self, event: str, **match: Any) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self.events if e.get("event") == event and all(e.get(k) == v for k, v in match.items())]

    def wait_event(self, event: str, timeout: float = 30.0, after: int = 0, **match: Any) -> dict[str, Any]:
        """The first ``event`` (matching ``match``) logged after the first ``after`` events."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for e in self.events[after:]:
                    if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no {event!r} event; log tail:\n" + "\n".join(self.lines[-25:]))
                self._cond.wait(min(left, 0.1))

    def mark(self) -> int:
        """Index for `wait_event(after=...)`: only events logged from now on."""
        with self._cond:
            return len(self.events)

    def wait_ready(self, timeout: float = 30.0) -> str:
        return self.wait_event("ready", timeout)["url"]

    @property
    def url(self) -> str:
        return self.find("ready")[0]["url"]

    def wait_exit(self, timeout: float = 30.0) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def status(self) -> dict[str, Any]:
        reply = send_command(self.runtime_dir / "control.sock", "status", timeout=10)
        assert reply["ok"], reply
        return reply["status"]

    def child_pids(self, role: str | None = None) -> dict[str, int]:
        """``{"engine-core-0": pid, ...}`` of the current children, from ``status``."""
        return {f"{c['role']}-{c['index']}": c["pid"] for c in self.status()["children"] if role in (None, c["role"])}

    def all_child_pids(self) -> set[int]:
        """Every child the supervisor ever started (from its log)."""
        return {e["child_pid"] for e in self.find("child_started")}

    def get(self, path: str, url: str | None = None, timeout: float = 10.0) -> httpx.Response:
        """One request on a fresh connection."""
        return httpx.get((url or self.url) + path, timeout=timeout, headers={"connection": "close"})

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        with self._cond:  # kept with pytest's last temporary directories, to read after a failure
            (self.workdir / "daemon.log").write_text("\n".join(self.lines) + "\n")
        for pid in self.all_child_pids():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


class NotifyListener:
    """A real ``NOTIFY_SOCKET``: a Unix datagram socket collecting sd_notify messages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def wait_for(self, key: str, value: str | None = None, timeout: float = 30.0, after: int = 0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, fields in self.messages[after:]:
                if key in fields and (value is None or fields[key] == value):
                    return fields
            time.sleep(0.05)
        raise AssertionError(f"no sd_notify {key}={value}; got {[m for _, m in self.messages]}")

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


class Load:
    """``clients`` threads sending requests until stopped, on fresh connections or keep-alive
    ones (as most HTTP clients do); counts failures."""

    def __init__(self, url: str, path: str = "/generate", clients: int = 4, keepalive: bool = False) -> None:
        self.url, self.path, self.keepalive = url, path, keepalive
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        client = httpx.Client(timeout=30, headers={} if self.keepalive else {"connection": "close"})
        while not self._stop.is_set():
            try:
                r = client.get(self.url + self.path)
                failure = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:100]}"
            except httpx.HTTPError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            with self._lock:
                if failure:
                    self.failures.append(failure)
                else:
                    self.ok += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def reload_and_wait(d: Daemon, config: dict[str, Any] | str | None, timeout: float = 60.0) -> dict[str, Any]:
    """Write ``config`` (merged over the daemon's, or raw text), SIGHUP, and return the first
    reload outcome event (``reload_applied`` / ``_rejected`` / ``_failed`` / ``_unchanged``)."""
    mark = d.mark()
    if config is not None:
        d.write_config(config if isinstance(config, str) else merge(d.config, config))
    d.signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [
            e for e in d.events[mark:] if e.get("event", "").startswith("reload_") and e["event"] != "reload_started"
        ]
        if done:
            return done[0]
        time.sleep(0.05)
    raise AssertionError("reload did not finish:\n" + "\n".join(d.lines[-20:]))


def free_port_pair() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 (for per-rank ports)."""
    for _ in range(100):
        port = random.randrange(20000, 60000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")
