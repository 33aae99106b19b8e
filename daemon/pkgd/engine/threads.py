"""Adapt the engine's CPU thread count to the cores it actually gets (``parallel.cpu_threads_adaptive``).

Why: an OpenMP region ends at a barrier that waits for its slowest thread. When another process
takes one of the cores the engine's threads run on, the thread sharing that core gets a time
slice now and then, and every one of the hundreds of parallel regions of a decode step waits
for it: with a busy loop on one of two cores, a 2-thread engine's steps take many times as long,
while one thread on the free core loses only what two threads gained over one.

How: `ThreadGovernor` watches the time per scheduled token of each step, grouped by the step's
shape (power-of-two buckets of its token count and of its request count: a prefill token costs
far less than a decode token). When steps of a shape become ``SLOWDOWN`` times slower than the
fastest of the recent ones at the current thread count (at most once per ``MIN_GAP`` of the
base probe interval), or every ``probe_every_s`` seconds of busy stepping, it probes: ``PAIRS`` pairs
of consecutive steps, one at the current count and one at the alternative (half of it while
above one thread; ``max_threads`` again from below, so a load that went away gives the cores
back). Paired steps see nearly the same batch, so the median of their per-token time ratios
compares the two counts under the load of that moment; the alternative wins when it is at least
``1 / WIN`` times faster. A pair whose alternative step is ``GIVE_UP`` times slower ends the
probe at once (a contended core makes a wider step many times slower: one such step is the whole
cost), and each probe that changes nothing doubles the interval to the next one of its kind (up
to ``MAX_BACKOFF`` times; unprompted probes and those a slowdown started back off separately, so a
quiet run's long unprompted interval never delays noticing a new load); such a probe keeps the
baselines, which still describe the load. A pair whose two steps differ in shape is not counted. Nothing here
is timed against a fixed figure: every decision is a ratio of two measurements taken side by
side.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable

from pkgd import log

logger = log.get_logger(__name__)

SLOWDOWN = 2.0  # recent per-token time over the bucket's best that starts a probe
WIN = 0.85  # the alternative must take at most this fraction of the current per-token time
PAIRS = 6  # step pairs per probe
GIVE_UP = 2.0  # an alternative step this many times slower ends the probe
MAX_BACKOFF = 8  # the unprompted probe interval grows to at most this many times its base
HISTORY = 32  # steps per bucket whose best is the baseline
RECENT = 4  # steps per bucket whose median is compared with the baseline
MIN_GAP = 0.1  # a slowdown starts a probe only after this fraction of the probe interval


class ThreadGovernor:
    """Chooses the intra-op thread count of each engine step.

    Args:
        max_threads: the configured count (``parallel.cpu_threads`` or its default); never exceeded.
        set_threads: applies a count (``torch.set_num_threads``; the CPU kernels follow it).
        probe_every_s: busy seconds between unprompted probes (a load that went away is only
            noticed by one).
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        *,
        probe_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._set = set_threads
        self._clock = clock
        self._probe_every_s = probe_every_s
        self._busy_s = 0.0
        self._history: dict[tuple[int, int, int], collections.deque[float]] = {}  # (threads, *shape)
        self._backoff = 1  # of unprompted probes: doubles with each that changes nothing
        self._slow_backoff = 1  # of probes a slowdown started: the same, separately
        self._prompted = False  # the open probe was started by a slowdown
        self._probe: list[float] | None = None  # alternative / current per-token time of each pair
        # The current count's (per-token time, shape) of an open pair.
        self._pending: tuple[float, tuple[int, int]] | None = None
        self._step_threads = max_threads
        self._started = 0.0
        self.changes = 0

    @property
    def active(self) -> bool:
        return self.max_threads > 1

    def _alternative(self) -> int:
        return max(1, self.threads // 2) if self.threads > 1 else self.max_threads

    def before_step(self) -> None:
        """Set the thread count of the step about to run (the alternative on a probe's odd steps)."""
        if not self.active:
            return
        want = self.threads
        if self._probe is not None and self._pending is not None:
            want = self._alternative()
        if want != self._step_threads:
            self._set(want)
            self._step_threads = want
        self._started = self._clock()

    def after_step(self, num_tokens: int, num_reqs: int = 1) -> None:
        """Record the step just run, of ``num_tokens`` scheduled tokens over ``num_reqs``
        requests; may start or end a probe."""
        if not self.active or num_tokens <= 0:
            return
        elapsed = self._clock() - self._started
        self._busy_s += elapsed
        per_token, shape = elapsed / num_tokens, (num_tokens.bit_length(), max(num_reqs, 1).bit_length())
        if self._probe is not None:
            self._record_probe(per_token, shape)
            return
        hist = self._history.setdefault((self.threads, *shape), collections.deque(maxlen=HISTORY))
        hist.append(per_token)
        interval = self._probe_every_s * self._backoff
        # A slowdown is gated by its own backoff, not the unprompted probes': those space the
        # probes of a steady load, and must not delay noticing a new one.
        slowed = (
            self._busy_s >= MIN_GAP * self._probe_every_s * self._slow_backoff
            and len(hist) > RECENT
            and statistics.median(list(hist)[-RECENT:]) > SLOWDOWN * min(hist)
        )
        if slowed or self._busy_s >= interval:
            self._probe, self._pending, self._busy_s, self._prompted = [], None, 0.0, slowed

    def _record_probe(self, per_token: float, shape: tuple[int, int]) -> None:
        assert self._probe is not None
        if self._pending is None:
            self._pending = (per_token, shape)  # the current count; the alternative runs next
            return
        (current, current_shape), self._pending = self._pending, None
        if shape != current_shape or current <= 0:
            return  # not comparable: the batch changed between the two steps
        ratio = per_token / current
        self._probe.append(ratio)
        if ratio >= GIVE_UP:
            self._end_probe(ratio)
        elif len(self._probe) >= PAIRS:
            self._end_probe(statistics.median(self._probe))

    def _end_probe(self, ratio: float) -> None:
        alternative = self._alternative()
        if ratio <= WIN:
            logger.info(
                "cpu_threads_changed",
                threads=alternative,
                previous=self.threads,
                per_token_ratio=round(ratio, 3),
                reason="measured faster under the load of the moment",
            )
            self.threads = alternative
            self.changes += 1
            self._backoff = self._slow_backoff = 1
            self._history.clear()  # baselines of the old load no longer apply
        elif self._prompted:
            self._slow_backoff = min(MAX_BACKOFF, self._slow_backoff * 2)
        else:
            # The load is what the baselines saw: kept, so a load arriving right after this
            # probe is a slowdown against them (cleared, its slow steps became the baseline
            # and only the next unprompted probe, up to MAX_BACKOFF intervals on, noticed it).
            self._backoff = min(MAX_BACKOFF, self._backoff * 2)
        self._probe = None
