"""The C heap of a CPU engine process (glibc ``malloc``), tuned before the weights load.

glibc serves a request above ``M_MMAP_THRESHOLD`` with its own ``mmap`` and unmaps it on
``free``; below it, from a heap that only shrinks from the top. By default the threshold
starts at 128 KiB and rises to the size of any mmapped block that is freed (up to 32 MiB), so
after the first large temporary every weight, activation and logits buffer under that size
lands in the heap: the dense weights freed after oneDNN packing, and activations of batch
sizes that vary every step, leave holes that are never returned. Measured on SmolLM2
(``benchmarks``, 2 threads): resident after loading 842 -> 805 MiB, and a 256-request
mixed-length run's growth after start-up ~130 -> ~75 MiB, with a fixed 1 MiB threshold; the
page faults on the larger temporaries were within run-to-run noise.

An operator's own ``MALLOC_MMAP_THRESHOLD_`` (glibc's tunable) wins; on other C libraries
this does nothing.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc <malloc.h>


def tune_cpu_allocator(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; True if applied."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)  # the process namespace: glibc when that is the C library
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, threshold) == 1
