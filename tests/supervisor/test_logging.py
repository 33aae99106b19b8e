"""The daemon's processes share one stderr: every log line must arrive whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys

WRITER = """
import sys
from pkgd import log
from pkgd.config.sections import LoggingConfig
log.configure(LoggingConfig(format="json"), role="api-server")
logger = log.get_logger("t")
for i in range(1500):
    logger.info("line", i=i, pad="x" * 200)
"""


def test_concurrent_processes_never_split_a_line():
    # PYTHONUNBUFFERED (common in containers) makes print() write the text and the newline
    # separately, so lines of processes sharing a pipe interleave unless written in one go.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-c",
        f"import subprocess, sys; ps = [subprocess.Popen([sys.executable, '-c', {WRITER!r}]) for _ in "
        "range(4)]; [p.wait() for p in ps]",
    ]
    out = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, timeout=120).stderr.decode().splitlines()
    assert len(out) == 6000
    assert all(json.loads(line)["event"] == "line" for line in out)


def test_logs_follow_sys_stderr_when_it_is_replaced(monkeypatch):
    """Configured once, the logger writes to the current ``sys.stderr``: an engine built later
    in the same process (the offline LLM after a CLI command, or the next test) must not fail
    on a stream that was closed since."""
    import io

    from pkgd import log
    from pkgd.config.sections import LoggingConfig

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    log.configure(LoggingConfig(format="json"), role="test")
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    log.get_logger("t").info("after_swap", n=1)
    assert json.loads(second.getvalue())["event"] == "after_swap"
    log.configure(role="test")
