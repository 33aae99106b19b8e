"""What a person (a terminal) and systemd (JSON lines on a pipe) see while `pkgd serve` starts
on a cold cache: the model preparation phases with their seconds, progress bars on the
terminal, one headline with the URL, and no warning. Slow: each start converts the GGUF and
builds the CPU kernels into an empty cache."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import httpx
import pytest
import yaml
from supervisor_helpers import merge

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not importlib.util.find_spec("pkgd.engine.core_proc"), reason="needs the real children"),
]

# a cold start of the default model, its GGUF dequantized once (model.quantization pinned to
# none: these are the float path's phases; the quantized path is tested in its own tests)
PHASES = ("convert_gguf", "dequantize_gguf", "cpu_kernels", "load_weights", "kv_cache")
CONFIG = {
    "frontend": {"port": 0},
    "cache": {"kv_cache_memory_bytes": 32 << 20},
    "model": {"max_model_len": 512, "quantization": "none"},
    "supervisor": {"engine_ready_timeout": 300},
}
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
STOPPING = re.compile(
    r"pkgd: stopping - in-flight requests get up to \S+ s \(supervisor.drain_timeout\) .*press Ctrl-C again"
)
HEADLINE = re.compile(
    r"pkgd ready: (http://127\.0\.0\.1:\d+) \(SmolLM2-135M-Instruct, 1 engine core, 1 API server\) "
    r"— try: curl (\S+)/v1/models"
)


def _env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PKGD_", "JOURNAL_STREAM", "CACHE_DIRECTORY"))}
    return env


def _tree(workdir: Path, config: dict) -> Path:
    etc = workdir / "etc"
    etc.mkdir()
    cfg = merge(
        config, {"model": {"cache_dir": str(workdir / "cache")}, "supervisor": {"runtime_dir": str(workdir / "run")}}
    )
    (etc / "pkgd.yaml").write_text(yaml.safe_dump(cfg))
    return etc


def _pkgd() -> str:
    return str(Path(sys.executable).with_name("pkgd"))


def _read_pty_until(fd: int, proc: subprocess.Popen, pattern: re.Pattern, timeout: float) -> tuple[str, float]:
    """What the terminal received until ``pattern`` matched (then one more second); and the
    longest silence in seconds before that."""
    raw, last, longest = b"", time.monotonic(), 0.0
    deadline, matched_at = time.monotonic() + timeout, None
    while time.monotonic() < deadline and (matched_at is None or time.monotonic() < matched_at + 1.0):
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        now = time.monotonic()
        if matched_at is None:
            longest, last = max(longest, now - last), now
        raw += chunk
        if matched_at is None and pattern.search(ANSI.sub("", raw.decode(errors="replace"))):
            matched_at = now
    return ANSI.sub("", raw.decode(errors="replace")), longest


@pytest.fixture
def workdir(tmp_path_factory):
    return Path(tmp_path_factory.mktemp("start", numbered=True))


def test_cold_start_on_a_terminal_shows_progress_and_a_headline(workdir):
    etc = _tree(workdir, CONFIG)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen(
        [_pkgd(), "serve", "--config-dir", str(etc)],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=_env(workdir),
        start_new_session=True,
    )
    os.close(slave)
    try:
        text, longest_silence = _read_pty_until(master, proc, HEADLINE, timeout=300)
        headline = HEADLINE.search(text)
        assert headline, text[-3000:]
        url = headline.group(1)
        assert headline.group(2) == url
        index = httpx.get(url + "/", timeout=10)
        assert index.status_code == 200 and index.json()["models"] == ["SmolLM2-135M-Instruct"]
    finally:
        proc.send_signal(signal.SIGINT)
        stopping, _ = _read_pty_until(master, proc, STOPPING, timeout=30)
        proc.wait(60)
        os.close(master)
    assert STOPPING.search(stopping), stopping[-2000:]  # Ctrl-C says what it waits for and the way out
    lines = text.replace("\r\n", "\n").split("\n")
    for name in PHASES:  # one readable line each, with its duration
        assert any(re.search(rf"model_phase .*phase={name} .*seconds=\d", line) for line in lines), name
    bars = [
        part
        for line in lines
        for part in line.split("\r")
        if re.match(r"(converting|loading weights|allocating)", part)
    ]
    assert any("tensor" in bar for bar in bars), lines  # tqdm drew the conversion and the weights
    assert "waiting_for_engine" in text
    assert not [line for line in lines if "warning" in line.lower() or "error" in line.lower()], text
    ready = next(i for i, line in enumerate(lines) if HEADLINE.search(line))
    assert re.search(r"\bready\b .*url=" + re.escape(url), lines[ready + 1])  # the structured line follows it
    assert longest_silence < 10, f"the terminal stayed silent for {longest_silence:.1f} s"


def test_cold_start_under_systemd_logs_one_json_line_per_phase(workdir):
    etc = _tree(workdir, merge(CONFIG, {"logging": {"format": "auto"}}))
    env = {**_env(workdir), "JOURNAL_STREAM": "8:1234"}  # as systemd sets it for a unit logging to the journal
    proc = subprocess.Popen(
        [_pkgd(), "serve", "--config-dir", str(etc)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    events = []
    try:
        for line in proc.stderr:
            events.append(json.loads(line))  # every line is JSON: no bar, no headline
            if events[-1]["event"] == "ready":
                break
        assert events and events[-1]["event"] == "ready", events[-5:]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    phases = {e["phase"]: e for e in events if e["event"] == "model_phase"}
    assert set(phases) == set(PHASES)
    assert all(
        isinstance(e["seconds"], float) and e["role"] == "engine-core" and e["dp_rank"] == 0 for e in phases.values()
    )
    assert phases["convert_gguf"]["tensors"] > 0 and phases["kv_cache"]["num_blocks"] > 0
    assert [e for e in events if e["level"] != "info"] == []
    ready = events[-1]
    assert set(ready) >= {"url", "urls", "mode", "engines", "api_servers", "config_hash"}
