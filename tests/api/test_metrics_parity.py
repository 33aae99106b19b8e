"""/metrics at parity with vLLM v1 (vllm/v1/metrics/loggers.py): every family, its type, the
model_name and engine labels, vLLM's buckets; engine counters are read, not summed."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pkgd.frontend.metrics import (
    E2E_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineStatsCollector,
    Metrics,
    request_tokens_buckets,
)
from pkgd.ipc.messages import ITERATION_TOKENS_BUCKETS, EngineCoreOutput, SchedulerStats

from .conftest import served

pytestmark = pytest.mark.anyio
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]

# family (as the parser names it, without _total) -> Prometheus type, as vLLM declares them
FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_num_preemptions": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
}


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _buckets(family) -> list[float]:
    return sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")} - {float("inf")})


async def test_every_vllm_family_with_its_type_labels_and_buckets(tokenizer):
    async with served(tokenizer) as (http, _state, fake):
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "n": 2})
        assert r.status_code == 200
        fams = _families((await http.get("/metrics")).text)
    for name, kind in FAMILIES.items():
        assert name in fams, name
        assert fams[name].type == kind, (name, fams[name].type)
        for sample in fams[name].samples:
            if name != "vllm:cache_config_info":  # vLLM's info gauge: config fields and engine only
                assert sample.labels.get("model_name") == "SmolLM2-135M-Instruct", (name, sample)
            assert sample.labels.get("engine") == "0", (name, sample)
    assert _buckets(fams["vllm:time_to_first_token_seconds"]) == list(TTFT_BUCKETS)
    assert _buckets(fams["vllm:e2e_request_latency_seconds"]) == list(E2E_BUCKETS)
    assert _buckets(fams["vllm:request_queue_time_seconds"]) == list(REQUEST_LATENCY_BUCKETS)
    assert (
        _buckets(fams["vllm:request_prompt_tokens"])
        == request_tokens_buckets(2048)
        == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    )
    assert _buckets(fams["vllm:iteration_tokens_total"]) == list(ITERATION_TOKENS_BUCKETS)

    def value(name: str, suffix: str, **labels: str) -> float:
        return sum(
            s.value
            for s in fams[name].samples
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
        )

    # n=2: two engine requests finished, one parent observed for n and the max generation
    assert value("vllm:request_success", "_total", finished_reason="length") == 2
    assert value("vllm:request_generation_tokens", "_count") == 2
    assert value("vllm:request_generation_tokens", "_sum") == 8
    assert value("vllm:request_params_n", "_count") == 1 and value("vllm:request_params_n", "_sum") == 2
    assert value("vllm:request_max_num_generation_tokens", "_sum") == 4
    assert value("vllm:request_params_max_tokens", "_sum") == 8
    assert value("vllm:request_queue_time_seconds", "_count") == 2
    prompt = value("vllm:request_prompt_tokens", "_sum") / 2
    assert value("vllm:prompt_tokens", "_total") == 2 * prompt
    info = [s for s in fams["vllm:cache_config_info"].samples]
    assert (
        info
        and info[0].value == 1
        and info[0].labels["block_size"] == "16"
        and info[0].labels["num_gpu_blocks"] == "128"
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_unfinished_engine_requests_end_as_abort_and_stop_strings_as_stop(anyio_backend):
    m = Metrics("m", max_model_len=64)
    m.track("r", ["0_r", "1_r"], 0, prompt_len=3, max_tokens=8)
    m.on_outputs(
        [
            EngineCoreOutput(request_id="0_r", new_token_ids=[5], queued_ts=1.0, scheduled_ts=1.5),
            EngineCoreOutput(request_id="1_r", new_token_ids=[6], queued_ts=1.0, scheduled_ts=1.5),
        ],
        step_ts=2.0,
        stopped=["1_r"],
    )  # 1_r hit a stop string in the frontend
    m.end("r")  # the client went away: 0_r was aborted
    fams = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}
    success = {s.labels["finished_reason"]: s.value for s in fams["vllm:request_success"].samples}
    assert success == {"abort": 1.0, "stop": 1.0}
    prefill = [s for s in fams["vllm:request_prefill_time_seconds"].samples if s.name.endswith("_sum")]
    assert prefill[0].value == pytest.approx(1.0)  # 2 x (2.0 - 1.5)


def test_requests_cut_has_every_reason_at_zero_before_any_cut():
    """Before the first cut each reason's series exists at 0 (a counter that appears only
    when it first moves hides the first increase from rate() and from absent() alerts)."""
    m = Metrics("m", max_model_len=64)
    fams = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}
    cut = {s.labels["reason"]: s.value for s in fams["pkgd:requests_cut"].samples if s.name.endswith("_total")}
    assert cut == {"engine_lost": 0.0, "drain_timeout": 0.0, "reload_drain_timeout": 0.0}
    m.count_cut("drain_timeout", 2)
    fams = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}
    cut = {s.labels["reason"]: s.value for s in fams["pkgd:requests_cut"].samples if s.name.endswith("_total")}
    assert cut["drain_timeout"] == 2.0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_engine_counters_are_the_cores_cumulative_numbers(anyio_backend):
    """Read from the newest SchedulerStats of each core (so N API servers do not multiply
    them); the step histogram's buckets accumulate the per-bucket counts."""
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    counts[0], counts[3], counts[-1] = 5, 2, 1  # 5 steps of 1 token, 2 of 17..32, 1 above 16384
    stats = {
        1: (
            None,
            SchedulerStats(
                prefix_cache_queries=300,
                prefix_cache_hits=64,
                num_preemptions=3,
                iteration_tokens_counts=counts,
                iteration_tokens_sum=5 + 50 + 20000,
            ),
        )
    }
    fams = {f.name: f for f in EngineStatsCollector("m", lambda: stats, {}).collect()}
    by_name = {s.name: s for f in fams.values() for s in f.samples if not s.name.endswith("_bucket")}
    assert (
        by_name["vllm:prefix_cache_queries_total"].value == 300 and fams["vllm:prefix_cache_queries"].type == "counter"
    )
    assert by_name["vllm:num_preemptions_total"].value == 3
    buckets = {
        s.labels["le"]: s.value for s in fams["vllm:iteration_tokens_total"].samples if s.name.endswith("_bucket")
    }
    assert buckets["1.0"] == 5 and buckets["16.0"] == 5 and buckets["32.0"] == 7 and buckets["+Inf"] == 8
    assert by_name["vllm:iteration_tokens_total_count"].value == 8
    assert not fams["vllm:cache_config_info"].samples  # no handshake: the core is down


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_spec_decode_counters_carry_vllms_names_and_positions(anyio_backend):
    stats = {
        0: (
            None,
            SchedulerStats(
                spec_decode_num_drafts=10,
                spec_decode_num_draft_tokens=40,
                spec_decode_num_accepted_tokens=25,
                spec_decode_accepted_per_pos=[10, 8, 5, 2],
            ),
        )
    }
    fams = {f.name: f for f in EngineStatsCollector("m", lambda: stats, {}).collect()}
    by_name = {s.name: s.value for f in fams.values() for s in f.samples if not s.name.endswith("_bucket")}
    assert by_name["vllm:spec_decode_num_drafts_total"] == 10
    assert by_name["vllm:spec_decode_num_draft_tokens_total"] == 40
    assert by_name["vllm:spec_decode_num_accepted_tokens_total"] == 25
    per_pos = {s.labels["position"]: s.value for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert per_pos == {"0": 10.0, "1": 8.0, "2": 5.0, "3": 2.0}
