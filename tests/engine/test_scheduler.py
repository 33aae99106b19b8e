"""Scheduler: token budget, chunked prefill, max_num_seqs, priority, preemption, aborts, stops.

Driven through `EngineCore` with the fake runner, whose outputs depend on the KV cache
content read back through the block tables (see fake_runner.py).
"""

import pytest

from pkgd.config import VllmConfig
from pkgd.engine.core import EngineCore
from pkgd.ipc.messages import EngineCoreRequest, FinishReason
from pkgd.sampling_params import SamplingParams

from .fake_runner import fake_factory


def make_engine(
    *,
    num_blocks=64,
    block_size=4,
    max_model_len=128,
    batched=64,
    seqs=16,
    chunked=True,
    policy="fcfs",
    caching=True,
    lookahead=None,
    threshold=0,
    **runner_kw,
):
    cfg = VllmConfig.model_validate(
        {
            "model": {"max_model_len": max_model_len},
            "cache": {"num_blocks": num_blocks, "block_size": block_size, "enable_prefix_caching": caching},
            "scheduler": {
                "max_num_batched_tokens": batched,
                "max_num_seqs": seqs,
                "enable_chunked_prefill": chunked,
                "policy": policy,
                "long_prefill_token_threshold": threshold,
            },
        }
    )
    engine = EngineCore(cfg, runner_factory=fake_factory(**runner_kw))
    if lookahead is not None:
        engine.scheduler.admission_lookahead = lookahead
    return engine


def add(engine, rid, prompt, priority=0, arrival=0.0, eos=None, **sp):
    sp.setdefault("temperature", 0.0)
    engine.add_request(
        EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(**sp),
            priority=priority,
            arrival_time=arrival,
            eos_token_id=eos,
        )
    )


def run(engine, max_steps=10_000):
    """Step to completion; returns {rid: (tokens, finish_reason, stop_reason)}."""
    results: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return results
        for out in engine.step():
            toks, _, _ = results.get(out.request_id, ([], None, None))
            results[out.request_id] = (toks + out.new_token_ids, out.finish_reason, out.stop_reason)
    raise AssertionError("engine did not finish")


def prompts(n, length=10):
    return [[(i * 37 + j * 11) % 997 + 1 for j in range(length + i % 5)] for i in range(n)]


def test_step_respects_the_token_budget_and_chunks_long_prompts():
    e = make_engine(batched=32)
    add(e, "long", range(1, 101), max_tokens=2)
    add(e, "short", range(200, 210), max_tokens=2)
    run(e)
    steps = e.model_runner.step_log
    assert all(s.total_num_scheduled_tokens <= 32 for s in steps)
    first = [s.num_scheduled_tokens.get("long", 0) for s in steps[:4]]
    assert first == [32, 32, 32, 4]  # chunked prefill of 100 tokens
    assert steps[3].num_scheduled_tokens["short"] == 10  # fits with the last chunk


def test_decodes_keep_running_while_a_long_prompt_is_chunked():
    e = make_engine(batched=16)
    add(e, "a", range(1, 5), max_tokens=8)
    e.step()  # a prefilled
    add(e, "long", range(100, 160), max_tokens=1)
    for _ in range(4):
        e.step()
        so = e.model_runner.step_log[-1]
        assert so.num_scheduled_tokens["a"] == 1 and so.num_scheduled_tokens["long"] == 15


def test_long_prefill_token_threshold_caps_one_requests_chunk():
    """vLLM's --long-prefill-token-threshold: no request computes more than 8 prompt tokens in
    a step, so two prompts prefill side by side and a running decode's steps stay short."""
    e = make_engine(batched=32, threshold=8)
    add(e, "a", range(1, 5), max_tokens=8)
    e.step()
    assert e.model_runner.step_log[-1].num_scheduled_tokens == {"a": 4}  # under the cap: whole
    add(e, "long", range(100, 130), max_tokens=1)
    add(e, "other", range(200, 219), max_tokens=1)
    steps, finished = [], set()
    for _ in range(4):
        finished |= {o.request_id for o in e.step() if o.finish_reason is not None}
        steps.append(dict(e.model_runner.step_log[-1].num_scheduled_tokens))
    assert [s.get("long", 0) for s in steps] == [8, 8, 8, 6]
    assert [s.get("other", 0) for s in steps] == [8, 8, 3, 0]
    assert all(s["a"] == 1 for s in steps)  # the decode runs every step
    assert finished == {"long", "other"}  # each got its one token once its prompt was in
    assert "a" in run(e)


def test_a_zero_threshold_leaves_the_budget_alone():
    e = make_engine(batched=32, threshold=0)
    add(e, "long", range(1, 101), max_tokens=1)
    run(e)
    assert [s.num_scheduled_tokens["long"] for s in e.model_runner.step_log[:4]] == [32, 32, 32, 4]


def test_without_chunked_prefill_a_prompt_waits_for_room():
    e = make_engine(batched=32, chunked=False)
    add(e, "a", range(1, 21), max_tokens=1)
    add(e, "b", range(30, 50), max_tokens=1)
    run(e)
    s0, s1 = e.model_runner.step_log[:2]
    assert s0.num_scheduled_tokens == {"a": 20}
    assert s1.num_scheduled_tokens == {"b": 20}


def test_max_num_seqs_caps_running_requests():
    e = make_engine(seqs=2, batched=64)
    for i, p in enumerate(prompts(5)):
        add(e, f"r{i}", p, max_tokens=4)
    res = run(e)
    assert len(res) == 5
    assert max(len(s.num_scheduled_tokens) for s in e.model_runner.step_log) == 2


def test_fcfs_admits_in_arrival_order():
    e = make_engine(seqs=1)
    for rid in ["x", "y", "z"]:
        add(e, rid, range(1, 5), max_tokens=2)
    run(e)
    order = [s.scheduled_new_reqs[0].req_id for s in e.model_runner.step_log if s.scheduled_new_reqs]
    assert order == ["x", "y", "z"]


def test_priority_policy_admits_lowest_priority_value_first():
    e = make_engine(seqs=1, policy="priority")
    add(e, "low", range(1, 5), priority=5, arrival=1.0, max_tokens=2)
    add(e, "high", range(1, 5), priority=-1, arrival=2.0, max_tokens=2)
    add(e, "mid-early", range(1, 5), priority=0, arrival=0.5, max_tokens=2)
    add(e, "mid-late", range(1, 5), priority=0, arrival=3.0, max_tokens=2)
    run(e)
    order = [s.scheduled_new_reqs[0].req_id for s in e.model_runner.step_log if s.scheduled_new_reqs]
    assert order == ["high", "mid-early", "mid-late", "low"]


def run_16(**kw):
    engine = make_engine(**kw)
    for i, p in enumerate(prompts(16, length=12)):
        add(engine, f"r{i}", p, max_tokens=20, priority=i % 3)
    return engine, run(engine)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_with_a_tiny_cache_gives_the_same_tokens(policy):
    ref, expected = run_16(num_blocks=512)
    assert ref.stats().num_preemptions == 0
    # 48 token slots for 16 requests; no admission lookahead (vLLM's policy) so blocks run out
    tiny, got = run_16(num_blocks=12, max_model_len=48, policy=policy, lookahead=0)
    assert got == expected
    assert tiny.stats().num_preemptions > 0
    assert tiny.kv_cache_manager.get_num_free_blocks() == 12
    assert tiny.stats().kv_cache_usage == 0.0


def test_admission_lookahead_avoids_recomputation():
    _, expected = run_16(num_blocks=512)
    plain, got_plain = run_16(num_blocks=12, max_model_len=48, lookahead=0)
    ahead, got_ahead = run_16(num_blocks=12, max_model_len=48)  # the default lookahead
    assert got_plain == got_ahead == expected
    computed = [sum(s.total_num_scheduled_tokens for s in e.model_runner.step_log) for e in (plain, ahead)]
    assert ahead.stats().num_preemptions == 0 < plain.stats().num_preemptions
    assert computed[1] < computed[0]


def test_requests_outgrowing_the_lookahead_are_still_preempted():
    ref, expected = run_16(num_blocks=512)
    e, got = run_16(num_blocks=12, max_model_len=48, lookahead=4)
    assert got == expected and e.stats().num_preemptions > 0
    assert e.kv_cache_manager.get_num_free_blocks() == 12


def test_priority_preemption_evicts_the_lowest_priority_request():
    e = make_engine(num_blocks=8, max_model_len=32, policy="priority", caching=False, lookahead=0)
    add(e, "vip", range(1, 13), priority=0, arrival=1.0, max_tokens=16)
    add(e, "bulk", range(20, 32), priority=9, arrival=0.0, max_tokens=16)
    run(e)
    assert e.stats().num_preemptions > 0
    preempted_ids = set().union(*(s.finished_req_ids for s in e.model_runner.step_log))
    assert "bulk" in preempted_ids
    vip_steps = [s for s in e.model_runner.step_log if "vip" in s.num_scheduled_tokens]
    assert len(vip_steps) == 1 + 15  # prefill + 15 decodes, never interrupted


def test_abort_frees_blocks_at_once_and_produces_no_more_output():
    e = make_engine(num_blocks=32)
    add(e, "a", range(1, 30), max_tokens=50)
    add(e, "b", range(40, 60), max_tokens=50)
    e.step()
    used = 32 - e.kv_cache_manager.get_num_free_blocks()
    assert used > 0
    e.abort_requests(["a", "b", "unknown"])
    assert e.kv_cache_manager.get_num_free_blocks() == 32
    assert not e.has_unfinished_requests()
    assert e.step() == []
    add(e, "c", range(1, 5), max_tokens=1)
    e.step()
    assert e.model_runner.step_log[-1].finished_req_ids == {"a", "b"}  # the runner drops them


def test_abort_of_a_waiting_request():
    e = make_engine(seqs=1)
    add(e, "a", range(1, 5), max_tokens=3)
    add(e, "b", range(1, 5), max_tokens=3)
    e.step()
    e.abort_requests(["b"])
    res = run(e)
    assert set(res) == {"a"}


def test_stop_rules():
    eos = 7
    e = make_engine(eos_token_id=eos, next_token=lambda toks: eos if len(toks) % 4 == 0 else len(toks) + 100)
    add(e, "eos", [1, 2, 3], eos=eos, max_tokens=10)  # 3 tokens: 103, then EOS at length 4
    add(e, "ignore", [1, 2, 3], eos=eos, max_tokens=6, ignore_eos=True)
    add(e, "stopid", [1, 2], eos=eos, max_tokens=10, stop_token_ids=[103])
    add(e, "min", [1, 2, 3], eos=eos, max_tokens=10, min_tokens=3)
    res = run(e)
    assert res["eos"] == ([103, eos], FinishReason.STOP, None)
    assert len(res["ignore"][0]) == 6 and res["ignore"][1] == FinishReason.LENGTH
    assert res["stopid"] == ([102, 103], FinishReason.STOP, 103)
    toks, reason, _ = res["min"]
    assert toks[:3] == [103, eos + 1, 105] and reason == FinishReason.STOP and toks[-1] == eos


def test_max_model_len_caps_a_request_without_max_tokens():
    e = make_engine(max_model_len=20)
    add(e, "a", range(1, 16), max_tokens=None)
    toks, reason, _ = run(e)["a"]
    assert len(toks) == 5 and reason == FinishReason.LENGTH


def test_prefix_cache_hit_is_counted_and_skips_compute():
    e = make_engine(block_size=4)
    shared = list(range(1, 17))
    add(e, "a", shared + [50], max_tokens=2)
    run(e)
    add(e, "b", shared + [60, 61], max_tokens=2)
    run(e)
    st = e.stats()
    assert st.prefix_cache_hits == 16
    assert st.prefix_cache_queries == 17 + 18
    new_b = [s for s in e.model_runner.step_log if s.scheduled_new_reqs and s.scheduled_new_reqs[0].req_id == "b"][0]
    assert new_b.scheduled_new_reqs[0].num_computed_tokens == 16
    assert new_b.num_scheduled_tokens["b"] == 2


def test_generated_tokens_are_prefix_cached_too():
    e = make_engine(block_size=4)
    add(e, "a", [1, 2, 3], max_tokens=9)
    toks = run(e)["a"][0]
    add(e, "b", [1, 2, 3] + toks[:8] + [999], max_tokens=1)  # same 11 tokens: 2 full blocks
    run(e)
    assert e.stats().prefix_cache_hits == 8


def test_identical_prompts_in_one_step_share_their_blocks():
    e = make_engine(block_size=4)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    add(e, "a", prompt, max_tokens=3)
    add(e, "b", prompt, max_tokens=3)
    first = e.model_runner.step_log  # both admitted in the first step
    res = run(e)
    new = {r.req_id: r.num_computed_tokens for r in first[0].scheduled_new_reqs}
    assert new == {"a": 0, "b": 12} and first[0].num_scheduled_tokens == {"a": 13, "b": 1}
    assert res["a"][0] == res["b"][0]
    assert e.kv_cache_manager.get_num_free_blocks() == 64


def _stress(seed, **kw):
    """Requests arriving while the engine steps, shared prefixes, mixed priorities and lengths."""
    import random

    rng = random.Random(seed)
    engine = make_engine(**kw)
    stems = [[rng.randrange(1, 900) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    pending = []
    for i in range(14):
        prompt = rng.choice(stems) + [rng.randrange(1, 900) for _ in range(rng.randint(1, 10))]
        pending.append((f"r{i}", prompt, rng.randint(0, 3), rng.randint(1, 14)))
    results, t = {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            rid, prompt, prio, n = pending.pop(0)
            add(engine, rid, prompt, priority=prio, arrival=float(t), max_tokens=n)
        for out in engine.step():
            toks = results.get(out.request_id, ([], None, None))[0]
            results[out.request_id] = (toks + out.new_token_ids, out.finish_reason, out.stop_reason)
        t += 1
    return engine, results


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(6))
def test_stress_small_cache_matches_large_cache(policy, seed):
    """The fake runner checks every block it reads holds the request's own tokens, so a block
    table, prefix hit or preemption that hands out the wrong KV fails here."""
    _, want = _stress(seed, num_blocks=256, max_model_len=40, policy=policy)
    e, got = _stress(seed, num_blocks=10, max_model_len=40, policy=policy, lookahead=0, batched=8, seqs=4)
    assert got == want
    assert e.kv_cache_manager.get_num_free_blocks() == 10


def test_outputs_carry_engine_timestamps_and_stats_count_tokens_per_step():
    """For /metrics: when a request was received and first scheduled (first output), its
    preemptions (last output), and a cumulative histogram of tokens per step."""
    import time

    from pkgd.ipc.messages import ITERATION_TOKENS_BUCKETS

    e = make_engine(batched=32)
    before = time.time()
    add(e, "long", range(1, 51), max_tokens=3)
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    first, last = outs[0], outs[-1]
    assert before <= first.queued_ts <= first.scheduled_ts <= time.time()
    assert outs[1].queued_ts == 0.0 and last.finish_reason is not None and last.num_preemptions == 0
    stats = e.stats()
    steps = e.model_runner.step_log
    assert sum(stats.iteration_tokens_counts) == len(steps) and stats.iteration_tokens_sum == 50 + 2
    by_bucket = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    for s in steps:  # 32 + 18 prompt tokens, then 1 + 1 decodes
        by_bucket[next(i for i, b in enumerate(ITERATION_TOKENS_BUCKETS) if s.total_num_scheduled_tokens <= b)] += 1
    assert stats.iteration_tokens_counts == by_bucket
