"""`Child`: the ready pipe and the exit of small real child programs."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from pkgd.supervisor.children import Child, ChildSpec, ChildStartError

WRITE_FRAME = """
import os, sys, signal
{before}
from pkgd.ipc import messages
fd = int(sys.argv[sys.argv.index("--ready-fd") + 1])
os.write(fd, messages.encode({frame}))
os.close(fd)
{after}
"""
HANDSHAKE = (
    "messages.Handshake(version=1, engine_index=0, pid=os.getpid(), model_name='m', max_model_len=16, "
    "vocab_size=8, eos_token_id=None, num_kv_blocks=2, block_size=16)"
)


def program(frame: str, after: str = "import time; time.sleep(30)", before: str = "") -> str:
    return WRITE_FRAME.format(before=before, frame=frame, after=after)


def run_child(code: str, role: str = "engine-core", then=None):
    async def main():
        spec = ChildSpec(role, 0, 0, (sys.executable, "-c", code), dict(os.environ))
        child = Child.spawn(spec, b"")
        try:
            frame = await asyncio.wait_for(asyncio.shield(child.ready), 20)
        except ChildStartError as exc:
            frame = exc
        result = await then(child) if then else None
        await child.stop(2.0)
        return frame, child, result

    return asyncio.run(main())


def test_handshake_makes_the_child_ready():
    frame, child, _ = run_child(program(HANDSHAKE))
    assert frame.model_name == "m" and frame.pid == child.pid
    assert child.returncode == -signal.SIGTERM  # stopped by stop()


def test_child_failed_carries_its_message_even_when_it_exits_at_once():
    code = program("messages.ChildFailed(role='engine-core', message='no weights at /x')", after="sys.exit(1)")
    frame, child, _ = run_child(code)
    assert isinstance(frame, ChildStartError) and "no weights at /x" in str(frame)


def test_exit_without_a_frame_and_garbage_are_errors():
    frame, _, _ = run_child("import sys; sys.exit(4)")
    assert "exited with exit code 4 before it was ready" in str(frame)
    code = (
        "import os, sys; fd = int(sys.argv[sys.argv.index('--ready-fd') + 1]); os.write(fd, b'\\xc1garbage'); "
        "os.close(fd); import time; time.sleep(30)"
    )
    frame, _, _ = run_child(code)
    assert "invalid ready frame" in str(frame)


def test_wrong_frame_for_the_role_is_an_error():
    frame, _, _ = run_child(program(HANDSHAKE), role="api-server")
    assert "sent Handshake as its ready frame" in str(frame)


def test_stop_kills_a_child_that_ignores_sigterm():
    code = program(HANDSHAKE, before="signal.signal(signal.SIGTERM, signal.SIG_IGN)")

    async def timed_stop(child):
        t0 = time.monotonic()
        rc = await child.stop(0.5)
        return rc, time.monotonic() - t0

    _, child, (rc, took) = run_child(code, then=timed_stop)
    assert rc == -signal.SIGKILL and 0.5 <= took < 3


def test_spawn_of_a_missing_program_raises_and_leaks_no_fd():
    before = len(os.listdir("/proc/self/fd"))

    async def main():
        Child.spawn(ChildSpec("engine-core", 0, 0, ("/nonexistent/python",), {}), b"")

    with pytest.raises(FileNotFoundError):
        asyncio.run(main())
    assert len(os.listdir("/proc/self/fd")) <= before + 1  # the loop's own fds may linger
