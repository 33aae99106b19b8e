"""What the host offers this process: cores it may run on and memory it may take.

One module for host probes, so the engine (KV budget, thread count), the offline `LLM` and the
supervisor (whether two engine generations fit side by side, whether a KV budget can fit at all)
read the same figures. Imports
nothing of pkgd.
"""

from __future__ import annotations

import math
import os


def available_cores() -> int:
    """CPU cores this process may run on: its affinity mask, capped by its cgroup's CPU quota
    rounded up (a container limited to 1.5 CPUs gets 2, to 1 CPU gets 1), not the machine's count.
    A quota below the mask matters: threads beyond it are throttled each period, and an OpenMP
    region waits at its barrier for the descheduled ones."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs this process's cgroup may use per period (quota / period), or None when unlimited
    or unknown. cgroup v2: ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") of the process's own
    cgroup and its ancestors, the smallest; v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    (-1 = unlimited). Kubernetes sets these from a container's CPU limit."""
    limits = [q for d in _cgroup_dirs(root, proc_cgroup) if (q := _read_quota(d)) is not None]
    return min(limits) if limits else None


def _cgroup_dirs(root: str, proc_cgroup: str) -> list[str]:
    """The cgroup directories that bound this process, innermost first."""
    try:
        with open(proc_cgroup, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            base = root
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            base = next(
                (os.path.join(root, n) for n in ("cpu,cpuacct", "cpu") if os.path.isdir(os.path.join(root, n))), ""
            )
            if not base:
                continue
        else:
            continue
        parts = [p for p in path.split("/") if p]
        out += [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]
    return out


def _read_quota(directory: str) -> float | None:
    try:
        with open(os.path.join(directory, "cpu.max"), encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us"), encoding="ascii") as f:
            quota_us = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us"), encoding="ascii") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


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
