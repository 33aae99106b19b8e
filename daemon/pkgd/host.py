"""What the host offers this process: cores it may run on and memory it may take.

One module for host probes, so the engine (KV budget, thread count), the offline `LLM` and the
supervisor (whether two engine generations fit side by side, whether a KV budget can fit at all)
read the same figures. Imports
nothing of pkgd.
"""

from __future__ import annotations

import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"


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


def cgroup_cpu_quota(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
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
    (``MemAvailable`` in /proc/meminfo), in bytes, or None where there is none; within a
    memory-limited cgroup (a container's ``resources.limits.memory``), at most what its limit
    leaves (`cgroup_memory`): /proc/meminfo there still describes the whole node."""
    host = _meminfo("MemAvailable")
    limit, used = cgroup_memory()
    if limit is None:
        return host
    left = max(0, limit - (used or 0))
    return left if host is None else min(host, left)


def mem_total_bytes() -> int | None:
    """The host's memory (``MemTotal`` in /proc/meminfo), in bytes, or None where there is
    none; a cgroup memory limit below it wins."""
    host = _meminfo("MemTotal")
    limit, _ = cgroup_memory()
    if limit is None:
        return host
    return limit if host is None else min(host, limit)


def cgroup_memory(root: str = CGROUP_ROOT) -> tuple[int | None, int | None]:
    """This process's cgroup memory ``(limit, usage)`` in bytes; limit None = unlimited.

    cgroup v2: ``memory.max`` and ``memory.current`` of the process's own cgroup (from
    /proc/self/cgroup's ``0::PATH`` line; a container sees its own at ``root``); v1:
    ``memory/memory.limit_in_bytes`` and ``memory.usage_in_bytes`` (a limit near 2**63
    means none). Usage leaves out the inactive file cache (`_working_set`). Anything
    unreadable counts as no limit.
    """
    own = _own_cgroup()
    for base in dict.fromkeys([os.path.join(root, own.lstrip("/")) if own else root, root]):
        limit = _read_int(os.path.join(base, "memory.max"))
        if limit is not None:
            return limit, _working_set(base, "memory.current", "inactive_file")
    limit = _read_int(os.path.join(root, "memory", "memory.limit_in_bytes"))
    if limit is not None and limit < 1 << 60:
        return limit, _working_set(os.path.join(root, "memory"), "memory.usage_in_bytes", "total_inactive_file")
    return None, None


def _working_set(base: str, usage_file: str, inactive_key: str) -> int | None:
    """Usage minus the inactive file cache (the kernel reclaims it before the limit bites;
    the kubelet's "working set" counts the same way)."""
    usage = _read_int(os.path.join(base, usage_file))
    if usage is None:
        return None
    try:
        with open(os.path.join(base, "memory.stat"), encoding="ascii") as f:
            stat = dict(line.split(maxsplit=1) for line in f if " " in line)
    except OSError:
        return usage
    inactive = stat.get(inactive_key, "0").strip()
    return max(0, usage - int(inactive)) if inactive.isdigit() else usage


def _own_cgroup() -> str | None:
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def _read_int(path: str) -> int | None:
    """An integer file's value; None when absent, unreadable or ``max``."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


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
