"""Prometheus metrics for `--enable-metrics`, with SGLang's metric names.

Request metrics (tokens, latencies) are observed in the HTTP process as outputs arrive; the
scheduler's gauges (running and queued requests, KV usage, cache hit rate, throughput) are
fetched from the scheduler process at each scrape, so one exposition holds both.
"""

from __future__ import annotations

import json
from argparse import Namespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from srv.engine.io import RequestOutput
from srv.engine.request_state import RequestState

DEFAULT_TTFT_BUCKETS = [0.05, 0.1, 0.25, 0.5, 0.75, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160]
DEFAULT_ITL_BUCKETS = [0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8,
                       1.0, 2.0, 4.0, 6.0, 8.0]
DEFAULT_E2E_BUCKETS = [0.1, 0.25, 0.5, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160, 240, 320, 480, 600, 1200, 1800]
DEFAULT_TOKEN_BUCKETS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def token_buckets(rule: list[str] | None) -> list[float]:
    """Buckets from a `--prompt-tokens-buckets` / `--generation-tokens-buckets` rule:
    `default`, `tse MIDDLE BASE COUNT` (MIDDLE +- BASE**i for i in 1..COUNT/2) or `custom V ...`."""
    if not rule or rule[0] == "default":
        if rule and len(rule) > 1:
            raise ValueError("the 'default' bucket rule takes no values")
        return list(DEFAULT_TOKEN_BUCKETS)
    kind, values = rule[0], rule[1:]
    try:
        numbers = [float(v) for v in values]
    except ValueError:
        raise ValueError(f"bucket rule {' '.join(rule)!r}: values must be numbers") from None
    if kind == "tse":
        if len(numbers) != 3 or numbers[2] < 2 or numbers[2] % 2:
            raise ValueError("the 'tse' bucket rule takes MIDDLE BASE COUNT with an even COUNT >= 2")
        middle, base, count = numbers
        offsets = [base ** i for i in range(1, int(count) // 2 + 1)]
        return sorted({middle - o for o in offsets} | {middle} | {middle + o for o in offsets})
    if kind == "custom":
        if not numbers:
            raise ValueError("the 'custom' bucket rule takes at least one value")
        return sorted(set(numbers))
    raise ValueError(f"unknown bucket rule {kind!r}: use default, tse or custom")


class HiCacheCollector:
    """The hierarchical cache's counters (prefix tokens found in each tier, bytes moved between
    tiers, storage pages that failed their checksum) from the scheduler's latest status."""

    TIERS = {"device": "device_hit_tokens", "host": "host_hit_tokens", "storage": "storage_hit_tokens"}
    MOVES = {"device_to_host": "device_to_host_bytes", "host_to_device": "host_to_device_bytes",
             "storage_read": "storage_read_bytes", "storage_written": "storage_written_bytes"}

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.values: dict[str, int] = {}

    def collect(self) -> Any:
        v = self.values
        if not v:
            return
        hits = CounterMetricFamily("sglang:hicache_hit_tokens", "Prompt tokens found in each cache tier",
                                   labels=["model_name", "tier"])
        for tier, key in self.TIERS.items():
            hits.add_metric([self.model_name, tier], v.get(key, 0))
        moved = CounterMetricFamily("sglang:hicache_bytes", "KV bytes moved between cache tiers",
                                    labels=["model_name", "direction"])
        for direction, key in self.MOVES.items():
            if key in v:
                moved.add_metric([self.model_name, direction], v[key])
        corrupt = CounterMetricFamily("sglang:hicache_corrupt_pages", "Storage pages skipped: checksum failed",
                                      labels=["model_name"])
        corrupt.add_metric([self.model_name], v.get("storage_corrupt_pages", 0))
        host = GaugeMetricFamily("sglang:hicache_host_tokens", "Tokens held by the host tier",
                                 labels=["model_name"])
        host.add_metric([self.model_name], v.get("host_tokens_in_use", 0))
        yield from (hits, moved, corrupt, host)


class ServerMetrics:
    def __init__(self, args: Namespace, model_name: str) -> None:
        self.model_name = model_name
        self.header = args.tokenizer_metrics_custom_labels_header.lower()
        self.custom_labels = list(args.tokenizer_metrics_allowed_custom_labels or [])
        labels = ["model_name", *self.custom_labels]
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Tokens generated", labels, registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache", labels,
                                     registry=r)
        self.requests = Counter("sglang:num_requests", "Requests finished", labels, registry=r)
        self.aborted = Counter("sglang:num_aborted_requests", "Requests aborted", labels, registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token", labels, registry=r,
                              buckets=args.bucket_time_to_first_token or DEFAULT_TTFT_BUCKETS)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Time between output tokens", labels, registry=r,
                             buckets=args.bucket_inter_token_latency or DEFAULT_ITL_BUCKETS)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Request latency from arrival to last token",
                             labels, registry=r, buckets=args.bucket_e2e_request_latency or DEFAULT_E2E_BUCKETS)
        prompt_buckets, generation_buckets = (token_buckets(args.prompt_tokens_buckets),
                                              token_buckets(args.generation_tokens_buckets))
        self.token_histograms = None
        if args.collect_tokens_histogram:
            self.token_histograms = (
                Histogram("sglang:prompt_tokens_histogram", "Prompt tokens per request", labels, registry=r,
                          buckets=prompt_buckets),
                Histogram("sglang:generation_tokens_histogram", "Generated tokens per request", labels, registry=r,
                          buckets=generation_buckets))
        # --enable-metrics-for-all-schedulers: a series per scheduler (data-parallel group),
        # labelled with its rank, instead of their sum.
        self.per_scheduler = bool(args.enable_metrics_for_all_schedulers)
        scheduler_labels = ["model_name", "dp_rank"] if self.per_scheduler else ["model_name"]
        self.gauges = {
            "running_requests": Gauge("sglang:num_running_reqs", "Requests running", scheduler_labels, registry=r),
            "waiting_requests": Gauge("sglang:num_queue_reqs", "Requests waiting", scheduler_labels, registry=r),
            "kv_tokens_in_use": Gauge("sglang:num_used_tokens", "KV cache tokens in use", scheduler_labels, registry=r),
            "token_usage": Gauge("sglang:token_usage", "Share of the KV cache in use", scheduler_labels, registry=r),
            "cache_hit_rate": Gauge("sglang:cache_hit_rate", "Share of prompt tokens found in the prefix cache",
                                    scheduler_labels, registry=r),
            "spec_accept_length": Gauge("sglang:spec_accept_length",
                                        "Tokens a speculative verify step gives a request, on average",
                                        scheduler_labels, registry=r),
            "gen_throughput": Gauge("sglang:gen_throughput", "Generated tokens per second, recent",
                                    scheduler_labels, registry=r),
        }
        if getattr(args, "enable_expert_distribution_metrics", False):
            self.gauges["expert_balancedness"] = Gauge(
                "srv:expert_balancedness", "MoE layers' mean over max tokens an expert, over recent forward passes",
                scheduler_labels, registry=r)
        self.hicache = HiCacheCollector(model_name)
        r.register(self.hicache)

    def labels_from_headers(self, headers: Any) -> dict[str, str]:
        """The allowed custom labels found in the custom-labels header (a JSON object)."""
        raw = headers.get(self.header)
        if not raw or not self.custom_labels:
            return {}
        try:
            given = json.loads(raw)
        except json.JSONDecodeError:
            return {}
        if not isinstance(given, dict):
            return {}
        return {k: str(v) for k, v in given.items() if k in self.custom_labels}

    def _label_values(self, state: RequestState) -> list[str]:
        return [self.model_name, *(state.labels.get(name, "") for name in self.custom_labels)]

    def observe(self, state: RequestState, out: RequestOutput) -> None:
        """Called after each update of a request (as `Frontend.observer`)."""
        if state.params.max_new_tokens == 0:   # the prompt prefill of an n > 1 request
            return
        labels = self._label_values(state)
        if out.new_ids:
            if len(state.output_ids) == len(out.new_ids):
                self.ttft.labels(*labels).observe(state.first_token_at - state.created_at)
            elif state.previous_token_at is not None:
                gap = (state.last_token_at - state.previous_token_at) / len(out.new_ids)
                for _ in out.new_ids:
                    self.itl.labels(*labels).observe(gap)
        if not state.finished:
            return
        self.requests.labels(*labels).inc()
        if state.finish_reason == "abort":
            self.aborted.labels(*labels).inc()
        self.prompt_tokens.labels(*labels).inc(len(state.prompt_ids))
        self.generation_tokens.labels(*labels).inc(len(state.output_ids))
        self.cached_tokens.labels(*labels).inc(state.cached_tokens)
        self.e2e.labels(*labels).observe((state.last_token_at or state.created_at) - state.created_at)
        if self.token_histograms is not None:
            self.token_histograms[0].labels(*labels).observe(len(state.prompt_ids))
            self.token_histograms[1].labels(*labels).observe(len(state.output_ids))

    def exposition(self, status: dict[str, Any]) -> tuple[bytes, str]:
        if self.per_scheduler:
            for rank, group in enumerate(status.get("data_parallel_groups") or [status]):
                self._set_gauges(group, self.model_name, str(rank))
        else:
            self._set_gauges(status, self.model_name)
        self.hicache.values = status.get("hicache") or {}
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _set_gauges(self, status: dict[str, Any], *labels: str) -> None:
        values = {
            **status,
            "token_usage": status["kv_tokens_in_use"] / max(status["kv_capacity_tokens"], 1),
            "cache_hit_rate": status["cached_prompt_tokens"] / max(status["prompt_tokens"], 1),
        }
        for key, gauge in self.gauges.items():
            if values.get(key) is not None:   # the expert balancedness before its first window
                gauge.labels(*labels).set(values[key])
