"""`pkgd.phases`: one log line per phase with its seconds; a bar only on a terminal."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys

import pytest
import structlog

from pkgd import phases


def test_a_phase_logs_one_line_with_its_seconds_and_fields(capsys):
    with structlog.testing.capture_logs() as logs:
        with phases.phase("load_weights", "loading weights", unit="tensor", dtype="float32") as p:
            p.set_total(3)
            for _ in range(3):
                p.advance()
            p.note(tensors=3)
    assert logs == [
        {
            "event": "model_phase",
            "log_level": "info",
            "phase": "load_weights",
            "seconds": logs[0]["seconds"],
            "dtype": "float32",
            "tensors": 3,
            "logger_name": "pkgd.phases",
        }
    ]
    assert p.done == 3 and isinstance(logs[0]["seconds"], float)
    assert capsys.readouterr().err == ""  # not a terminal: no bar


def test_a_failed_phase_logs_nothing():
    with structlog.testing.capture_logs() as logs, pytest.raises(ValueError):
        with phases.phase("convert_gguf", "converting"):
            raise ValueError("corrupt")
    assert logs == []


DRAW = """
import time
from pkgd import log, phases
log.configure(None, role="test")
phases.allow_bars({allowed})
with phases.phase("kv_cache", "allocating KV cache", total=4, unit="layer") as p:
    for _ in range(4):
        time.sleep(0.3)
        p.advance()
"""


@pytest.mark.parametrize("allowed", [True, False])
def test_on_a_terminal_a_bar_is_drawn_then_erased(allowed):
    master, slave = pty.openpty()  # left unsized (0 x 0), as some terminals report
    proc = subprocess.Popen(
        [sys.executable, "-c", DRAW.format(allowed=allowed)], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(30) == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.decode(errors="replace"))  # the log line's colours
    assert text.count("model_phase") == 1 and "phase=kv_cache" in text
    if allowed:
        assert "allocating KV cache: 100%" in text and "4/4" in text and "layer/s" in text
        assert text.rindex("\r" + " " * 20) < text.index("model_phase")  # erased before the log line
    else:
        assert "allocating KV cache" not in text
