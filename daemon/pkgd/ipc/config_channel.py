"""The config channel: how the supervisor hands a child its configuration, over a pipe.

The supervisor spawns each child with the read end of a private pipe (``--config-fd N``) and
writes frames to it: one at once (the configuration of the child's generation), then one
more for every reload that changes live fields of that generation. A frame is a 4-byte
big-endian length and the validated tree as JSON, secrets included.

Why a pipe, not a file: the secrets (``frontend.api_keys``) then never touch a disk, so
nothing is left behind when the supervisor is killed (``kill -9``: the children die with it
and the pipes with them); each child reads exactly the configuration of its own generation,
also after a crash restart during a reload; and a frame arrives whole or not at all, so a
child never reads a half-written file. Children started by hand take ``--config-file PATH``
instead (then SIGHUP re-reads the file).

Torch-free: both children import this.
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pkgd.config.vllm_config import VllmConfig

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 16 << 20  # a config is a few KiB; anything near this is not one


def encode_config(config: VllmConfig) -> bytes:
    """One frame carrying ``config`` with its secrets."""
    data = json.dumps(config.to_json_dict(reveal_secrets=True), sort_keys=True).encode()
    return _HEADER.pack(len(data)) + data


def decode_config(data: bytes) -> VllmConfig:
    """The `VllmConfig` of one frame's payload (raises ``ValueError`` when invalid)."""
    from pkgd.config.vllm_config import VllmConfig

    return VllmConfig.model_validate(json.loads(data))


class ConfigReader:
    """The child's end: blocking `read_first` at start, non-blocking `read_available` after.

    ``closed`` turns true when the supervisor's end is closed (it is gone); a caller watching
    the fd stops then. A malformed frame raises ``ValueError``.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.closed = False
        self._buf = b""
        os.set_blocking(fd, False)

    def fileno(self) -> int:
        return self.fd

    def read_first(self, timeout: float = 30.0) -> VllmConfig:
        """Wait up to ``timeout`` seconds for the first frame.

        Raises ``EOFError`` when the pipe closes first, ``TimeoutError`` when nothing came.
        """
        deadline = time.monotonic() + timeout
        while True:
            frames = self.read_available()
            if frames:
                return frames[-1]
            if self.closed:
                raise EOFError(f"the configuration pipe (fd {self.fd}) closed before a configuration arrived")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no configuration arrived on fd {self.fd} within {timeout:g} s")
            select.select([self.fd], [], [], left)

    def read_available(self) -> list[VllmConfig]:
        """The frames that arrived complete since the last call (oldest first)."""
        while not self.closed:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                self.closed = True
                break
            self._buf += chunk
        frames = []
        while len(self._buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf)
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"configuration frame of {size} bytes is too large")
            if len(self._buf) < _HEADER.size + size:
                break
            payload, self._buf = self._buf[_HEADER.size : _HEADER.size + size], self._buf[_HEADER.size + size :]
            frames.append(decode_config(payload))
        return frames
