"""Prometheus metrics with vLLM v1's names, types, labels and buckets, so vLLM's dashboards and
alerts work unchanged (``vllm/v1/metrics/loggers.py``; the families are listed in
``docs/metrics.md``). Every series carries ``model_name`` and ``engine`` (the data-parallel
rank of the engine core).

Two sources:

* **requests**, counted by the API server that handled them (`Metrics.track` … `end`):
  token counters, finish reasons, and the per-request histograms. Latencies the client sees
  (TTFT, inter-token, end-to-end) are measured here on the monotonic clock; the phases inside
  the engine (queue, prefill, decode, inference) come from the engine core's timestamps
  (`EngineCoreOutput.queued_ts` / ``scheduled_ts`` and `EngineOutputs.timestamp`), so both
  ends of each interval are on one clock. With several API-server processes,
  ``PROMETHEUS_MULTIPROC_DIR`` (set by the supervisor) puts prometheus_client in multiprocess
  mode and a scrape of any API server sums them over all;
* **engine cores**, reported at scrape time from the newest `SchedulerStats` of each core
  (`EngineStatsCollector`): queue gauges, KV usage, the prefix-cache and preemption counters
  and the tokens-per-step histogram, which the core keeps cumulatively, plus
  ``vllm:cache_config_info``. Every API server receives every core's stats, so they are
  read, not summed: no count is multiplied by the number of API servers.

Units: seconds and tokens.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client import multiprocess as mp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pkgd.ipc.messages import ITERATION_TOKENS_BUCKETS, EngineCoreOutput, Handshake, SchedulerStats

# vLLM v1's bucket families (vllm/v1/metrics/buckets.py), in seconds or counts.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
E2E_BUCKETS = REQUEST_LATENCY_BUCKETS
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
LABELS = ["model_name", "engine"]


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's ``request_tokens`` family: 1, 2, 5, 10, 20, 50 … up to ``max_model_len``."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return out
            out.append(mantissa * scale)
        scale *= 10


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


# Why a request in flight was ended from outside (``pkgd:requests_cut_total{reason}``): a lost
# engine core, the shutdown drain deadline, a replaced generation's drain deadline.
CUT_REASONS = ("engine_lost", "drain_timeout", "reload_drain_timeout")


@dataclasses.dataclass
class _Timer:
    """One engine request's timing and counts (monotonic ``t_*``; engine Unix ``*_ts``)."""

    engine: str
    max_tokens: int | None
    t_arrival: float
    t_last: float | None = None
    num_tokens: int = 0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_ts: float = 0.0
    last_ts: float = 0.0
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclasses.dataclass
class _Tracked:
    """One client request: its engine requests' timers (``n`` of them) and prompt length."""

    prompt_len: int
    timers: dict[str, _Timer]
    done: set[str] = dataclasses.field(default_factory=set)
    max_generation_tokens: int = 0


class Metrics:
    """The request metrics of one API-server process, for the served model ``model_name``;
    ``max_model_len`` bounds the token-count buckets."""

    def __init__(self, model_name: str, *, max_model_len: int = 131072) -> None:
        disable_created_metrics()  # no *_created series (vLLM disables them too)
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        tokens = request_tokens_buckets(max_model_len)

        def counter(name: str, doc: str, extra: Iterable[str] = ()) -> Counter:
            return Counter(name, doc, [*LABELS, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=tuple(buckets), registry=r)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ["finished_reason"]
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.request_prefill_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        self.max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions", "Number of preemptions per request.", REQUEST_NUM_PREEMPTIONS_BUCKETS
        )
        # pkgd's own: requests that were running and were ended from outside, by why
        # (engine_lost, drain_timeout, reload_drain_timeout); a reload cuts none.
        self.requests_cut = Counter(
            "pkgd:requests_cut",
            "Requests in flight ended with an error by a deadline or a lost engine core.",
            ["model_name", "reason"],
            registry=r,
        )
        for reason in CUT_REASONS:  # every series at 0 from the start, so rate() and alerts see them
            self.requests_cut.labels(self.model_name, reason)
        self._tracked: dict[str, _Tracked] = {}
        self._by_engine_id: dict[str, str] = {}

    # ---- request events (called by AsyncLLM) --------------------------------------------

    def count_cut(self, reason: str, num: int = 1) -> None:
        """``num`` requests in flight were ended with an error for ``reason``."""
        self.requests_cut.labels(self.model_name, reason).inc(num)

    def track(
        self, request_id: str, engine_ids: Iterable[str], engine_index: int, *, prompt_len: int, max_tokens: int | None
    ) -> None:
        """Start timing client request ``request_id`` whose engine requests run on core
        ``engine_index``; ``max_tokens`` is the client's parameter (None when it gave none)."""
        now = time.monotonic()
        timers = {eid: _Timer(str(engine_index), max_tokens, now) for eid in engine_ids}
        self._tracked[request_id] = _Tracked(prompt_len, timers)
        for eid in timers:
            self._by_engine_id[eid] = request_id

    def on_outputs(self, outputs: Iterable[EngineCoreOutput], step_ts: float, stopped: Iterable[str] = ()) -> None:
        """One engine step's outputs (``step_ts``: the core's Unix time of the step);
        ``stopped``: engine requests the frontend ended (a stop string), so finished too."""
        now = time.monotonic()
        for out in outputs:
            rid = self._by_engine_id.get(out.request_id)
            if rid is None:
                continue
            tracked = self._tracked[rid]
            timer = tracked.timers[out.request_id]
            self._tokens(tracked, timer, out, now, step_ts)
            if out.finish_reason is not None:
                self._child_finished(rid, out.request_id, str(out.finish_reason))
        for eid in stopped:
            if (rid := self._by_engine_id.get(eid)) is not None:
                self._child_finished(rid, eid, "stop")

    def end(self, request_id: str) -> None:
        """The client request is over: engine requests that did not finish were aborted."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        for eid in list(tracked.timers):
            if eid not in tracked.done:
                self._child_finished(request_id, eid, "abort")
        self._tracked.pop(request_id, None)

    def _tokens(self, tracked: _Tracked, timer: _Timer, out: EngineCoreOutput, now: float, step_ts: float) -> None:
        num = len(out.new_token_ids)
        if out.queued_ts:
            timer.queued_ts, timer.scheduled_ts = out.queued_ts, out.scheduled_ts
            timer.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            timer.num_preemptions = out.num_preemptions
        if not num:
            return
        labels = (self.model_name, timer.engine)
        self.generation_tokens.labels(*labels).inc(num)
        if timer.t_last is None:
            self.ttft.labels(*labels).observe(now - timer.t_arrival)
            self.prompt_tokens.labels(*labels).inc(tracked.prompt_len)
            timer.first_ts = step_ts
        else:
            # tokens that arrive together share the interval (vLLM observes per step too)
            self.itl.labels(*labels).observe((now - timer.t_last) / num)
        timer.t_last, timer.last_ts = now, step_ts
        timer.num_tokens += num

    def _child_finished(self, request_id: str, engine_id: str, reason: str) -> None:
        tracked = self._tracked[request_id]
        if engine_id in tracked.done:
            return
        tracked.done.add(engine_id)
        self._by_engine_id.pop(engine_id, None)
        t = tracked.timers[engine_id]
        labels = (self.model_name, t.engine)
        now = time.monotonic()
        self.request_success.labels(*labels, reason).inc()
        self.e2e.labels(*labels).observe(now - t.t_arrival)
        self.request_prompt.labels(*labels).observe(tracked.prompt_len)
        self.request_generation.labels(*labels).observe(t.num_tokens)
        self.request_prefill_computed.labels(*labels).observe(max(tracked.prompt_len - t.num_cached_tokens, 0))
        self.request_preemptions.labels(*labels).observe(t.num_preemptions)
        if t.max_tokens:
            self.params_max_tokens.labels(*labels).observe(t.max_tokens)
        if t.scheduled_ts and t.first_ts:  # it reached the engine and produced a token
            self.queue_time.labels(*labels).observe(max(t.scheduled_ts - t.queued_ts, 0.0))
            self.prefill_time.labels(*labels).observe(max(t.first_ts - t.scheduled_ts, 0.0))
            self.decode_time.labels(*labels).observe(max(t.last_ts - t.first_ts, 0.0))
            self.inference_time.labels(*labels).observe(max(t.last_ts - t.scheduled_ts, 0.0))
            if t.num_tokens > 1:
                self.tpot.labels(*labels).observe((t.last_ts - t.first_ts) / (t.num_tokens - 1))
        tracked.max_generation_tokens = max(tracked.max_generation_tokens, t.num_tokens)
        if len(tracked.done) == len(tracked.timers):  # the last of the n: the parent's figures
            self.max_generation.labels(*labels).observe(tracked.max_generation_tokens)
            self.params_n.labels(*labels).observe(len(tracked.timers))

    # ---- exposition ----------------------------------------------------------------------

    def render(self, engines: Collector | None = None) -> tuple[bytes, str]:
        """The exposition text (the daemon's request totals in multiprocess mode, plus
        ``engines``' series) and its content type."""
        registry = CollectorRegistry()
        if multiprocess_dir() is None:
            registry.register(self.registry)
        else:
            mp.MultiProcessCollector(registry)
        if engines is not None:
            registry.register(engines)
        return generate_latest(registry), CONTENT_TYPE_LATEST

    @staticmethod
    def mark_process_dead(pid: int | None = None) -> None:
        """Drop this process's live files (at exit); counters stay in the totals."""
        if multiprocess_dir() is not None:
            mp.mark_process_dead(pid or os.getpid())


Collector = Any  # prometheus_client's informal collector protocol (``collect()``)


class EngineStatsCollector:
    """The engine cores' series at scrape time (see the module docstring).

    ``engines()`` returns, per engine index, the core's `Handshake` (None while it is down)
    and its newest `SchedulerStats`; ``cache_info`` holds the ``vllm:cache_config_info``
    labels that come from the config (``num_gpu_blocks`` comes from each handshake).
    """

    def __init__(
        self,
        model_name: str,
        engines: Callable[[], Mapping[int, tuple[Handshake | None, SchedulerStats]]],
        cache_info: Mapping[str, str],
    ) -> None:
        self.model_name = model_name
        self.engines = engines
        self.cache_info = dict(cache_info)

    def collect(self) -> Iterable[Any]:
        gauges = {
            "num_requests_running": ("Number of requests in model execution batches.", lambda s: s.num_running_reqs),
            "num_requests_waiting": ("Number of requests waiting to be processed.", lambda s: s.num_waiting_reqs),
            "kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_cache_usage),
        }
        counters = {
            "prefix_cache_queries": (
                "Prefix cache queries, in terms of number of queried tokens.",
                lambda s: s.prefix_cache_queries,
            ),
            "prefix_cache_hits": (
                "Prefix cache hits, in terms of number of cached tokens.",
                lambda s: s.prefix_cache_hits,
            ),
            "num_preemptions": ("Cumulative number of preemption from the engine.", lambda s: s.num_preemptions),
            "spec_decode_num_drafts": ("Number of spec decoding drafts.", lambda s: s.spec_decode_num_drafts),
            "spec_decode_num_draft_tokens": (
                "Number of draft tokens.",
                lambda s: s.spec_decode_num_draft_tokens,
            ),
            "spec_decode_num_accepted_tokens": (
                "Number of accepted tokens.",
                lambda s: s.spec_decode_num_accepted_tokens,
            ),
        }
        engines = sorted(self.engines().items())
        for name, (doc, get) in gauges.items():
            family = GaugeMetricFamily(f"vllm:{name}", doc, labels=LABELS)
            for index, (_, stats) in engines:
                family.add_metric([self.model_name, str(index)], get(stats))
            yield family
        for name, (doc, get) in counters.items():
            counter = CounterMetricFamily(f"vllm:{name}", doc, labels=LABELS)
            for index, (_, stats) in engines:
                counter.add_metric([self.model_name, str(index)], get(stats))
            yield counter
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for index, (_, stats) in engines:
            for pos, count in enumerate(stats.spec_decode_accepted_per_pos):
                per_pos.add_metric([self.model_name, str(index), str(pos)], count)
        yield per_pos
        steps = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels=LABELS
        )
        for index, (_, stats) in engines:
            steps.add_metric(
                [self.model_name, str(index)], _cumulative(stats.iteration_tokens_counts), stats.iteration_tokens_sum
            )
        yield steps
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*self.cache_info, "num_gpu_blocks", "engine"],
        )
        for index, (handshake, _) in engines:
            if handshake is not None:
                info.add_metric([*self.cache_info.values(), str(handshake.num_kv_blocks), str(index)], 1)
        yield info
        yield from _lora_info(engines)


def _lora_info(engines: list[tuple[int, tuple[Handshake | None, SchedulerStats]]]) -> Iterable[Any]:
    """vLLM's ``vllm:lora_requests_info``: a gauge whose labels carry the adapter slots and the
    comma-joined names of the adapters of running and waiting requests, and whose value is
    the time of the engine's stats (seconds since the epoch); only while LoRA is on."""
    served = [(index, stats) for index, (_, stats) in engines if stats.max_lora]
    if not served:
        return
    family = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters", "engine"],
    )
    for index, stats in served:
        family.add_metric(
            [str(stats.max_lora), ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters),
             str(index)],
            time.time(),
        )  # fmt: skip
    yield family


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    """Prometheus ``le`` buckets from per-bucket step counts (`SchedulerStats`)."""
    counts = counts or [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    total = 0
    out: list[tuple[str, float]] = []
    for bound, count in zip((*ITERATION_TOKENS_BUCKETS, float("inf")), counts, strict=True):
        total += count
        out.append(("+Inf" if bound == float("inf") else str(float(bound)), total))
    return out


def cache_config_labels(config: Any) -> dict[str, str]:
    """``vllm:cache_config_info`` labels of a `VllmConfig` (vLLM prints values with ``str``)."""
    c = config.cache
    return {
        "block_size": str(c.block_size),
        "cache_dtype": str(c.cache_dtype),
        "enable_prefix_caching": str(c.enable_prefix_caching),
        "gpu_memory_utilization": str(c.gpu_memory_utilization),
        "kv_cache_memory_bytes": str(c.kv_cache_memory_bytes),
        "num_gpu_blocks_override": str(c.num_blocks),
        "prefix_caching_hash_algo": "sha256",
    }
