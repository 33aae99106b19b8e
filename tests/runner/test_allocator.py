"""`pkgd.runner.allocator`: the engine fixes glibc's mmap threshold unless the operator did."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pkgd.runner.allocator import tune_cpu_allocator

# A child process: mallopt changes the whole process, and the test must not change pytest's.
PROBE = """
import ctypes, sys
from pkgd.runner.allocator import tune_cpu_allocator
applied = tune_cpu_allocator() if sys.argv[1] == "tune" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))  # by default this raises glibc's threshold to 4 MiB
p = libc.malloc(3 << 19)  # 1.5 MiB: mmapped only while the threshold stays at 1 MiB
mmapped = bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2)  # IS_MMAPPED
print(applied, mmapped)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_threshold_stays_fixed_so_freed_blocks_go_back():
    def probe(mode):
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env).stdout.split()

    assert probe("default") == ["None", "False"]  # glibc's dynamic threshold: heap
    assert probe("tune") == ["True", "True"]


def test_operator_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(4 << 20))
    assert tune_cpu_allocator() is False
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == str(4 << 20)
