"""Long streams through reloads and a SIGTERM: 16 streaming clients on keep-alive connections,
4 asking for streams several times ``supervisor.drain_timeout`` long (`cases.TEST_MIX`, the
daemon of `cases.long_stream_config`), the others short, all back to back.

What must hold: a reload (api class; engine class by overlap and by stop_first) fails no
request: the replaced generation serves every request it accepted to its end (bounded by
``supervisor.reload_drain_timeout``, 600 s by default, not by ``drain_timeout``) and takes no
new one once the new generation is ready; every stream ends with its full token count and
``[DONE]``. A SIGTERM cuts what is still running at ``drain_timeout`` with an error event and
``[DONE]``, never silently (``cut``, ``short``) or by leaving it hanging. Run alone with
``-m faults``; the cases share one daemon and run in order (SIGTERM last).
"""

from __future__ import annotations

import collections

import pytest
from cases import LONG_DRAIN_TIMEOUT, TEST_MIX, Case, long_api_reload, long_engine_reload, long_sigterm

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def _show(case: Case) -> str:
    """The case's summary, its kinds for long and short streams apart, and its first failures
    (client, tokens asked, kind, tokens the usage chunk gave, events, [DONE], start and end relative to
    when the replaced generation began to drain or the SIGTERM, detail)."""
    mix = case.info["mix"]
    t0 = case.info["drain_from"]
    by_length = {
        length: dict(collections.Counter(o.kind for o in case.outcomes if (o.client < mix.long) == is_long))
        for length, is_long in (("long", True), ("short", False))
    }
    first = [
        (
            o.client,
            o.max_tokens,
            o.kind,
            o.tokens,
            f"{o.events} events",
            "[DONE]" if o.done else "no [DONE]",
            f"{o.started - t0:+.1f}..{o.ended - t0:+.1f} s",
            o.detail[:120],
        )
        for o in case.failures()[:5]
    ]
    info = {k: v for k, v in case.info.items() if k not in ("mix", "drain_from")}
    return f"{case.name} ({mix}): {case.summary}; by length: {by_length}; {info}; first failures: {first}"


def _assert_no_request_failed(case: Case) -> None:
    assert case.info["old_exited"], "the replaced generation did not exit: " + _show(case)
    assert not case.failures(), _show(case)
    served = [o for o in case.outcomes if o.kind != "cancelled"]
    assert all(o.done and o.tokens == o.max_tokens for o in served), _show(case)
    s = case.summary
    assert s["failed"] == 0 and s["truncated"] == 0 and s["done"] == s["sent"] == s["ok"], _show(case)
    assert s["ok"] >= 2 * TEST_MIX.clients, _show(case)
    # the case tested something: a long stream ran on past the replaced generation's
    # drain_timeout (it started before that generation began to drain, ended drain_timeout after)
    t0 = case.info["drain_from"]
    spanning = [o for o in case.long() if o.started < t0 and o.ended > t0 + LONG_DRAIN_TIMEOUT]
    assert spanning, "no long stream spanned the reload: " + _show(case)


def test_an_api_reload_finishes_long_streams(long_daemon):
    case = long_api_reload(long_daemon, TEST_MIX)
    assert {n.rsplit("-", 1)[0] for n in case.info["replaced"]} == {"api-server"}, case.info["replaced"]
    _assert_no_request_failed(case)


def test_an_engine_reload_by_overlap_finishes_long_streams(long_daemon):
    case = long_engine_reload(long_daemon, TEST_MIX, "overlap")
    assert len(case.info["replaced"]) == 3, "engine core and both API servers are a new generation"
    _assert_no_request_failed(case)


def test_an_engine_reload_by_stop_first_finishes_long_streams(long_daemon):
    case = long_engine_reload(long_daemon, TEST_MIX, "stop_first")
    assert len(case.info["replaced"]) == 3, "engine core and both API servers are a new generation"
    _assert_no_request_failed(case)


def test_sigterm_past_drain_timeout_ends_long_streams_with_an_error_event(long_daemon):
    case = long_sigterm(long_daemon, TEST_MIX)
    assert case.info["exit_code"] == 0, _show(case)
    kinds = case.summary["kinds"]
    # whatever is cut is cut cleanly: an error event and [DONE] on a stream, a 503 before one
    assert set(kinds) <= {"ok", "error_event", "refused", "http_503"}, _show(case)
    assert all(o.done for o in case.outcomes if o.kind in ("ok", "error_event")), _show(case)
    stopped = case.info["drain_from"]
    fresh = [o for o in case.outcomes if o.client == case.info["fresh_long_client"] and o.started <= stopped <= o.ended]
    assert [o.kind for o in fresh] == ["error_event"], "the long stream begun just before SIGTERM: " + _show(case)
    assert kinds.get("refused", 0) >= 1, _show(case)
