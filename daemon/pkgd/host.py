"""What the host offers this process: cores it may run on and memory it may take.

One module for host probes, so the engine (KV budget, thread count), the offline `LLM` and the
supervisor (whether two engine generations fit side by side, whether a KV budget can fit at all)
read the same figures. Imports
nothing of pkgd.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def mem_available_bytes() -> int | None:
    """Linux's estimate of memory available to new allocations without swapping
    (``MemAvailable`` in /proc/meminfo), in bytes, or None where there is none."""
    return _meminfo("MemAvailable")


def mem_total_bytes() -> int | None:
    """The host's memory (``MemTotal`` in /proc/meminfo), in bytes, or None where there is none."""
    return _meminfo("MemTotal")


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def set_torch_huge_pages(enabled: bool) -> None:
    """Tell torch's CPU allocator whether to put allocations of 2 MiB or more on transparent
    huge pages (``THP_MEM_ALLOC_ENABLE``), unless the operator set it. Torch reads it once, at
    its first CPU allocation, so engine processes call this before building the model
    (``parallel.cpu_huge_pages``): decode streams every weight from memory each token and reads
    2 MiB pages faster."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1" if enabled else "0")
