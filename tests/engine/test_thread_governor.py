"""`ThreadGovernor`: the step thread count follows measured per-token times (a fake clock whose
step durations a model of the host sets), never a fixed figure."""

from __future__ import annotations

import pytest

from pkgd.engine.threads import PAIRS, ThreadGovernor


class Host:
    """Step durations by thread count, as the host's load makes them (seconds per token)."""

    def __init__(self, per_token: dict[int, float]) -> None:
        self.per_token = per_token
        self.now = 0.0
        self.threads = max(per_token)
        self.applied: list[int] = []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.applied.append(n)

    def run(self, gov: ThreadGovernor, steps: int, tokens: int = 64) -> list[int]:
        """Run ``steps`` steps; the thread count each ran with."""
        used = []
        for _ in range(steps):
            gov.before_step()
            used.append(self.threads)
            self.now += self.per_token[self.threads] * tokens
            gov.after_step(tokens)
        return used


def _governor(host: Host, **kw) -> ThreadGovernor:
    return ThreadGovernor(max(host.per_token), host.set_threads, clock=lambda: host.now, **kw)


def test_quiet_host_keeps_every_thread_and_never_probes_early():
    host = Host({1: 1.8e-3, 2: 1.0e-3})
    gov = _governor(host, probe_every_s=1e9)
    assert set(host.run(gov, 200)) == {2} and gov.threads == 2 and host.applied == []


def test_a_contended_core_drops_to_one_thread_within_a_few_steps():
    host = Host({1: 1.8e-3, 2: 1.0e-3})
    gov = _governor(host, probe_every_s=30.0)
    host.run(gov, 40)
    host.per_token = {1: 2.0e-3, 2: 20e-3}  # a busy loop took one core: 2 threads wait at every barrier
    used = host.run(gov, 20)
    assert gov.threads == 1 and gov.changes == 1
    # The slowdown is seen after a few slow steps, and the probe's first pair decides.
    assert used.count(2) <= 8 and used[-5:] == [1] * 5


def test_a_contended_core_is_noticed_as_fast_after_a_long_quiet_run():
    """Unprompted probes on a quiet host back off (each changes nothing), but that backoff
    must not delay reacting to a slowdown: with the busy loop started after many quiet
    probes, one thread runs after as few slow steps as on a fresh start, not after the
    backed-off interval's tenth (24 busy s at 8 x 30 s: 19 steps of this host's)."""
    host = Host({1: 1.8e-3, 2: 1.0e-3})
    gov = _governor(host, probe_every_s=30.0)
    host.run(gov, 20_000)  # 1,280 busy s: probes at 30, 60, 120, 240, 240 ... s, none won
    while gov._probe is None:  # the load arrives just after an unprompted probe
        host.run(gov, 1)
    while gov._probe is not None:
        host.run(gov, 1)
    assert gov.threads == 2
    host.per_token = {1: 2.0e-3, 2: 20e-3}
    used = host.run(gov, 40)
    assert gov.threads == 1 and used[-5:] == [1] * 5
    assert used.count(2) <= 8, used  # as soon as after a fresh start (the test above)


def test_a_slowdown_fewer_threads_do_not_cure_backs_off_its_probes():
    """Steps 10x slower at every count (the whole box loaded): each probe the slowdown starts
    ends after its first pair, and they back off (3, 6, 12, 24, 24 ... busy s apart)."""
    host = Host({1: 1.8e-3, 2: 1.0e-3})
    gov = _governor(host, probe_every_s=30.0)
    host.run(gov, 400)
    host.per_token = {1: 36e-3, 2: 10e-3}
    used = host.run(gov, 1000)  # 640 busy s
    assert gov.threads == 2 and gov.changes == 0
    assert 0 < used.count(1) <= 40, used.count(1)  # about 30 one-step probes, not one per 3 s (213)


def test_the_cores_come_back_when_the_load_goes():
    host = Host({1: 2.0e-3, 2: 20e-3})
    gov = _governor(host, probe_every_s=2.0)
    host.run(gov, 40)
    assert gov.threads == 1
    host.per_token = {1: 1.8e-3, 2: 1.0e-3}  # the other process ended
    host.run(gov, 400)
    assert gov.threads == 2


def test_a_failed_probe_costs_one_slow_step_and_backs_off():
    """Under lasting contention each unprompted probe of 2 threads ends after its first pair,
    and the interval to the next one doubles."""
    host = Host({1: 2.0e-3, 2: 20e-3})
    gov = _governor(host, probe_every_s=1.0)
    used = host.run(gov, 2000)
    assert gov.threads == 1
    slow = used[20:].count(2)
    # 2000 steps x 0.128 s = 256 busy s; probes at 1, 2, 4, 8, 8, ... s intervals: about 33
    assert 0 < slow <= 40


def test_prefill_and_decode_steps_of_one_size_are_not_a_slowdown():
    """A 64-token prefill of one request costs far less per token than 64 decodes: steps are
    compared within their shape (tokens and requests), so alternating them starts no probe."""
    host = Host({1: 1.8e-3, 2: 1.0e-3})
    gov = _governor(host, probe_every_s=30.0)  # 200 steps: 9 busy s, past MIN_GAP, short of 30
    for i in range(200):
        gov.before_step()
        host.now += 64 * (0.1e-3 if i % 3 == 0 else 1.0e-3)  # every third step a prefill
        gov.after_step(64, 1 if i % 3 == 0 else 64)
    assert host.applied == [] and gov.changes == 0


def test_a_small_gain_is_not_worth_a_change():
    host = Host({1: 1.0e-3, 2: 0.95e-3})  # one thread would be 5% slower: noise-level, keep 2
    gov = _governor(host, probe_every_s=0.5)
    host.run(gov, 500)
    assert gov.threads == 2 and gov.changes == 0


def test_pairs_of_different_step_sizes_are_not_compared():
    host = Host({1: 1.0e-3, 2: 10e-3})
    gov = _governor(host, probe_every_s=0.0)
    gov.before_step()
    host.now += 1.0
    gov.after_step(64)  # starts a probe
    for i in range(PAIRS * 2):  # each pair: 64 tokens at 2 threads, then 4 tokens at 1
        for tokens in (64, 4):
            gov.before_step()
            host.now += host.per_token[host.threads] * tokens
            gov.after_step(tokens)
    assert gov.changes == 0


@pytest.mark.parametrize("max_threads", [1])
def test_one_thread_is_never_governed(max_threads):
    calls = []
    gov = ThreadGovernor(max_threads, calls.append)
    gov.before_step()
    gov.after_step(8)
    assert not gov.active and calls == []


def test_the_engine_governs_a_cpu_runner_of_its_own_process_only():
    import types

    import torch

    from pkgd.config import VllmConfig
    from pkgd.engine.core import _thread_governor

    cpu = types.SimpleNamespace(device=torch.device("cpu"))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gov = _thread_governor(VllmConfig(), cpu)
        assert gov is not None and gov.max_threads == 2
        off = VllmConfig.model_validate({"parallel": {"cpu_threads_adaptive": False}})
        assert _thread_governor(off, cpu) is None
        tp2 = VllmConfig.model_validate({"parallel": {"tp": 2}})
        assert _thread_governor(tp2, cpu) is None  # the ranks' threads are in other processes
        assert _thread_governor(VllmConfig(), object()) is None  # a runner with no device (a fake)
        torch.set_num_threads(1)
        assert _thread_governor(VllmConfig(), cpu) is None  # one thread: nothing to choose
    finally:
        torch.set_num_threads(before)


def test_the_c_kernels_follow_the_count_the_governor_sets():
    """The governor sets torch's count; the C kernels' OpenMP regions must run with it too."""
    import torch

    from pkgd_kernels import cpu

    try:
        kernels = cpu.load()
    except cpu.CpuKernelsUnavailable as exc:
        pytest.skip(f"the C kernels do not build here: {exc}")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernels.num_threads() == 1
        torch.set_num_threads(2)
        assert kernels.num_threads() == 2
    finally:
        torch.set_num_threads(before)
