"""Fixtures of the supervisor tests (helpers in supervisor_helpers.py)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from supervisor_helpers import Daemon, NotifyListener


@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="pkgd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_daemon(workdir):
    daemons: list[Daemon] = []

    def start(
        config: dict[str, Any] | None = None,
        *,
        env: dict[str, str] | None = None,
        argv: list[str] | None = None,
        name: str = "",
        real: bool = False,
    ) -> Daemon:
        d = workdir / (name or f"d{len(daemons)}")
        d.mkdir()
        daemon = Daemon(d, config or {}, env, argv, real)
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        daemon.cleanup()


@pytest.fixture
def notify_socket(workdir):
    listener = NotifyListener(workdir / "notify.sock")
    yield listener
    listener.close()
