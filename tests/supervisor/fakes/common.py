"""Shared bits of the fake children: the child-process contract without a model.

The fakes honour the contract the real ``pkgd.engine.core_proc`` and ``pkgd.api.server``
implement (argv, ready frame, the config pipe, PDEATHSIG, SIGTERM), so the supervisor's
tests exercise real processes, real pipes and real sockets in milliseconds.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal

from pkgd.config.vllm_config import VllmConfig
from pkgd.ipc import messages

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the supervisor died before PDEATHSIG was armed


def load_config(path: str) -> VllmConfig:
    with open(path) as f:
        return VllmConfig.model_validate(json.load(f))


def config_source(args):
    """The child's `ConfigSource` (``--config-fd`` from the supervisor, or ``--config-file``)."""
    from pkgd.ipc.child import ConfigSource

    return ConfigSource(args.config_fd, args.config_file)


def fake_options(text: str | None, prefix: str) -> dict[str, str]:
    """``"fake:load=0.5,fail=boom"`` → ``{"load": "0.5", "fail": "boom"}`` (empty otherwise)."""
    if not text or not text.startswith(prefix):
        return {}
    opts = {}
    for item in text[len(prefix) :].split(","):
        key, _, value = item.partition("=")
        if key:
            opts[key] = value
    return opts


def report(fd: int, msg: messages.Message) -> None:
    os.write(fd, messages.encode(msg))
    os.close(fd)
