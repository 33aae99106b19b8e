"""Timed phases of model preparation: one log line each, and a progress bar on a terminal.

Preparing a model takes seconds to minutes on a cold cache (converting a GGUF file, building
the CPU kernels, loading the weights, allocating the KV cache). Each step runs inside
`phase`::

    with phases.phase("load_weights", "loading weights", total=n, unit="tensor") as p:
        for ... :
            p.advance()

and ends with one structured line, ``model_phase phase=load_weights seconds=1.84 …``: under
systemd (JSON lines) the journal gets one line per phase with its duration. When the process
logs to a terminal (`pkgd.log.is_console`) a tqdm bar also shows the phase while it runs,
redrawn every `REFRESH_S` seconds even when nothing advances (a long single step such as
writing a file still shows its elapsed time), and erased when the phase ends, so the
terminal keeps the log line only. A phase that raises logs nothing (its caller reports the
error).

Only one process per terminal should draw bars: the engine cores other than data-parallel
rank 0 and tensor-parallel workers other than rank 0 call ``allow_bars(False)`` or pass
``bar=False`` (their phases still log).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from pkgd import log

REFRESH_S = 0.5  # how often a bar is redrawn while its phase runs
UNCOUNTED_FORMAT = "{desc} ({elapsed})"  # a phase without a total yet: its time so far

logger = log.get_logger("pkgd.phases")
_bars_allowed = True


def allow_bars(allowed: bool) -> None:
    """Whether this process may draw progress bars at all (False: log lines only)."""
    global _bars_allowed
    _bars_allowed = allowed


class Phase:
    """The running phase handed out by `phase`: advance it, set its total, add fields to its
    log line."""

    def __init__(self, name: str, desc: str, total: int | None, unit: str, show_bar: bool) -> None:
        self.name = name
        self.fields: dict[str, Any] = {}
        self.done = 0
        self._started = time.perf_counter()
        self._bar: Any = None
        self._stop = threading.Event()
        if show_bar:
            from tqdm.auto import tqdm

            # A pseudo-terminal nobody sized reports 0 x 0, where tqdm would draw nothing.
            sized = _terminal_columns() > 0
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                leave=False,
                mininterval=REFRESH_S,
                dynamic_ncols=sized,
                ncols=None if sized else 80,
                nrows=None if sized else 24,
                bar_format=None if total else UNCOUNTED_FORMAT,
            )
            threading.Thread(target=self._refresh, name=f"phase-{name}", daemon=True).start()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._started

    def set_total(self, total: int) -> None:
        """The number of steps, once known."""
        if self._bar is not None:
            self._bar.total = total
            self._bar.bar_format = None  # tqdm's bar, now that there is a total
            self._bar.refresh()

    def advance(self, n: int = 1) -> None:
        """``n`` more steps done."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def note(self, **fields: Any) -> None:
        """Fields for the phase's log line (``tensors=272``)."""
        self.fields.update(fields)

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self._bar.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.close()


def _terminal_columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def bars_wanted() -> bool:
    """Whether a phase here draws a bar: this process may, and it logs to a terminal."""
    return _bars_allowed and log.is_console()


@contextlib.contextmanager
def phase(
    name: str, desc: str, *, total: int | None = None, unit: str = "it", bar: bool = True, **fields: Any
) -> Iterator[Phase]:
    """Run one phase named ``name`` (``convert_gguf``); ``desc`` labels its bar; ``fields``
    go on its log line with ``seconds``. See the module docstring."""
    p = Phase(name, desc, total, unit, bar and bars_wanted())
    try:
        yield p
    finally:
        p.close()
    logger.info("model_phase", phase=name, seconds=round(p.seconds, 2), **fields, **p.fields)
