"""CPU time taken by processes other than the ones under test, sampled during a phase.

A phase's figures only compare with another phase's when the box around them was equally quiet.
The box's busy time comes from the first line of /proc/stat (``user nice system idle iowait irq
softirq steal ...`` in clock ticks, summed over all CPUs; guest time is already inside user);
the processes under test (the server's session, the client's session, the harness itself, the
busy loop of the contention phase) are read from /proc/PID/stat (utime + stime, fields 14-15).
What is left is everyone else: ``others = box busy - ours``, as a share of the box's capacity
over the phase (every CPU's ticks), so 0.5 on a 2-core box is one whole core.

A tracked process that exits between two samples loses at most one interval of its time
(which then counts as "others"); with 0.5 s samples that is noise next to a 10% threshold.
"""

from __future__ import annotations

import dataclasses
import os
import threading

WARN_SHARE = 0.10
"""Share of the box taken by other processes above which a phase's figures get a warning."""


@dataclasses.dataclass(frozen=True)
class BoxTicks:
    """Clock ticks of every CPU together from /proc/stat's ``cpu`` line."""

    busy: int
    total: int


def parse_proc_stat(text: str) -> BoxTicks:
    """The aggregate ``cpu`` line of /proc/stat as busy and total ticks. Busy = user + nice +
    system + irq + softirq + steal; total = busy + idle + iowait (guest and guest_nice are
    already counted in user and nice, so they are left out). Raises `ValueError` when the line
    is missing."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            f = [int(x) for x in line.split()[1:]]
            f += [0] * (8 - len(f))
            user, nice, system, idle, iowait, irq, softirq, steal = f[:8]
            busy = user + nice + system + irq + softirq + steal
            return BoxTicks(busy=busy, total=busy + idle + iowait)
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def parse_pid_stat(text: str) -> tuple[int, int]:
    """``(session id, utime + stime ticks)`` from the text of /proc/PID/stat. The command name
    (field 2) may hold spaces and parentheses, so fields are counted after its last ')'."""
    rest = text.rsplit(")", 1)[1].split()
    # rest[0] is field 3 (state): field N is rest[N - 3]
    return int(rest[6 - 3]), int(rest[14 - 3]) + int(rest[15 - 3])


def others_share(box0: BoxTicks, box1: BoxTicks, ours_ticks: int) -> float:
    """Share of the box's capacity (0..1) used by processes other than ours between two
    /proc/stat readings, ``ours_ticks`` being the ticks our processes used in between. Never
    below 0 (ticks are sampled at slightly different instants)."""
    total = box1.total - box0.total
    if total <= 0:
        return 0.0
    return max(0, (box1.busy - box0.busy) - ours_ticks) / total


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _box() -> BoxTicks:
    return parse_proc_stat(_read("/proc/stat") or "")


class OthersSampler(threading.Thread):
    """Samples, every ``interval`` seconds, the ticks of the processes in ``sessions`` (session
    ids) and ``pids``; `stop` returns the share of the box (0..1) used by everyone else since
    the sampler started. Each process's ticks are counted from the first time it is seen (or
    from 0 when it started after the sampler did), so processes born in the phase count whole."""

    def __init__(self, sessions: set[int], pids: set[int], interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.sessions, self.pids, self.interval = set(sessions), set(pids), interval
        self._halt = threading.Event()
        self._first: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._box0 = _box()
        self._sample(initial=True)

    def add_session(self, sid: int) -> None:
        self.sessions.add(sid)

    def _sample(self, initial: bool = False) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            text = _read(f"/proc/{entry}/stat")
            if text is None:
                continue
            pid = int(entry)
            try:
                sid, ticks = parse_pid_stat(text)
            except (IndexError, ValueError):
                continue
            if pid in self.pids or sid in self.sessions:
                self._first.setdefault(pid, ticks if initial else 0)
                self._last[pid] = ticks

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self._sample()

    def stop(self) -> float:
        """Stops sampling; the others' share of the box over the sampler's life."""
        self._halt.set()
        self.join(timeout=5)
        self._sample()
        ours = sum(self._last[p] - self._first[p] for p in self._last)
        return others_share(self._box0, _box(), ours)
