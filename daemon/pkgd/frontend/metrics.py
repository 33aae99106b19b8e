"""Prometheus metrics with vLLM's names, so existing vLLM dashboards and alerts work.

Counters and histograms are counted by the API server that handled the request; gauges
come from the engine cores' `SchedulerStats` (labelled ``engine``). With several API-server
processes, ``PROMETHEUS_MULTIPROC_DIR`` (set by the supervisor before the process starts)
puts prometheus_client in multiprocess mode: every process writes its values to files there
and a scrape of any API server sums counters and histograms over all of them; gauges use
``mostrecent`` mode (each API server receives the same engine stats, so the newest write
wins).

Buckets are vLLM v1's (``vllm/v1/metrics/loggers.py``), in seconds.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import multiprocess as mp
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pkgd.ipc.messages import SchedulerStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class Metrics:
    """The metrics of one API-server process, for the served model ``model_name``."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series (vLLM disables them too)
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", labels, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests, by finish reason.", [*labels, "finished_reason"], registry=r
        )
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token, seconds.", labels, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens, seconds.", labels, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency, seconds.", labels, buckets=E2E_BUCKETS, registry=r)
        gauge_labels = [*labels, "engine"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the engine's running batch.", gauge_labels, multiprocess_mode="mostrecent", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", gauge_labels, multiprocess_mode="mostrecent", registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1.", gauge_labels, multiprocess_mode="mostrecent", registry=r)
        self.preemptions = Gauge("vllm:num_preemptions", "Preemptions since the engine started.", gauge_labels, multiprocess_mode="mostrecent", registry=r)
        self.prefix_queries = Gauge("vllm:prefix_cache_queries", "Prefix-cache token queries since the engine started.", gauge_labels, multiprocess_mode="mostrecent", registry=r)
        self.prefix_hits = Gauge("vllm:prefix_cache_hits", "Prefix-cache token hits since the engine started.", gauge_labels, multiprocess_mode="mostrecent", registry=r)

    # ---- request events (called by AsyncLLM) --------------------------------------------

    def first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.labels(self.model_name).observe(ttft_s)
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def tokens(self, num_tokens: int, since_last_s: float | None) -> None:
        """``num_tokens`` new output tokens; ``since_last_s`` since the previous ones (None
        for the first tokens of a request)."""
        self.generation_tokens.labels(self.model_name).inc(num_tokens)
        if since_last_s is not None and num_tokens:
            # tokens that arrive together share the interval (vLLM observes per step too)
            self.itl.labels(self.model_name).observe(since_last_s / num_tokens)

    def finished(self, reason: str, e2e_s: float) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(e2e_s)

    # ---- engine gauges + exposition ------------------------------------------------------

    def set_engine_stats(self, stats: dict[int, SchedulerStats]) -> None:
        for index, s in stats.items():
            key = (self.model_name, str(index))
            self.running.labels(*key).set(s.num_running_reqs)
            self.waiting.labels(*key).set(s.num_waiting_reqs)
            self.kv_usage.labels(*key).set(s.kv_cache_usage)
            self.preemptions.labels(*key).set(s.num_preemptions)
            self.prefix_queries.labels(*key).set(s.prefix_cache_queries)
            self.prefix_hits.labels(*key).set(s.prefix_cache_hits)

    def render(self) -> tuple[bytes, str]:
        """The exposition text (the daemon's totals in multiprocess mode) and its type."""
        if multiprocess_dir() is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        mp.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST

    @staticmethod
    def mark_process_dead(pid: int | None = None) -> None:
        """Drop this process's live gauge files (at exit); counters stay in the totals."""
        if multiprocess_dir() is not None:
            mp.mark_process_dead(pid or os.getpid())
