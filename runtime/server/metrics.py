"""Prometheus metrics of one server (its own registry: no process-wide globals)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from plait.protocol import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


# the EngineStats fields /metrics reports as counters (monotone over engine restarts:
# the front carries a dead engine's values over, Replica.carry_counters)
COUNTER_FIELDS = ("cache_queried_tokens", "cache_hit_tokens", "cache_evicted_tokens", "retractions",
                  "cache_early_divergences", "hicache_saved_tokens", "hicache_loaded_tokens", "hicache_prefetched_tokens",
                  "spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")


class _ByReplica:
    """The replicas' stats by field: ``s.running`` is ``[replica 0's, replica 1's, ...]``."""

    def __init__(self, stats: list[EngineStats]) -> None:
        self._stats = stats

    def __getattr__(self, name: str) -> list[float]:
        return [getattr(s, name) for s in self._stats]


class _EngineCollector(Collector):
    """Reads each engine replica's latest :class:`EngineStats` at scrape time: one
    sample per replica (label ``replica``, its data-parallel rank)."""

    def __init__(self, stats: Callable[[], list[EngineStats]], model: str) -> None:
        self.stats = stats
        self.model = model

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = _ByReplica(self.stats())
        labels = ["model_name", "replica"]

        def gauge(name: str, doc: str, values: list[float]) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for rank, value in enumerate(values):
                g.add_metric([self.model, str(rank)], value)
            return g

        def counter(name: str, doc: str, values: list[float]) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            for rank, value in enumerate(values):
                c.add_metric([self.model, str(rank)], value)
            return c

        yield gauge("plait_num_running_reqs", "Requests running in the engine.", s.running)
        yield gauge("plait_num_waiting_reqs", "Requests waiting for admission.", s.waiting)
        yield gauge("plait_kv_pages_used", "KV pages held by running requests (not evictable).", s.pages_used)
        yield gauge("plait_kv_pages_evictable", "KV pages holding cached prefixes nobody uses now.", s.pages_evictable)
        yield gauge("plait_kv_pages_total", "KV pages in the pool.", s.pages_total)
        yield gauge("plait_kv_page_size", "Tokens per KV page.", s.page_size)
        yield counter("plait_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.", s.cache_queried_tokens)
        yield counter("plait_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", s.cache_hit_tokens)
        yield counter("plait_prefix_cache_evicted_tokens", "Tokens evicted from the prefix cache.", s.cache_evicted_tokens)
        yield counter("plait_retractions", "Requests retracted for lack of KV memory.", s.retractions)
        yield counter("plait_prefix_cache_early_divergences", "Long prompts that left a longer cached prefix within "
                      "their first 64 tokens (a per-request value early in a shared prompt?).", s.cache_early_divergences)
        yield counter("plait_hicache_saved_tokens", "Tokens copied to the host-memory tier.", s.hicache_saved_tokens)
        yield counter("plait_hicache_loaded_tokens", "Tokens copied back from the host-memory tier instead of "
                      "recomputed.", s.hicache_loaded_tokens)
        yield counter("plait_hicache_prefetched_tokens", "Of those, tokens copied while their request waited "
                      "(prefetch).", s.hicache_prefetched_tokens)
        yield gauge("plait_window_kv_pages_total", "Pages of the sliding-window layers' own KV pool.", s.window_pages_total)
        yield gauge("plait_window_kv_pages_attached", "Window KV pages holding windowed KV.", s.window_pages_attached)
        yield counter("plait_spec_verify_steps", "Request-steps that verified speculative drafts.", s.spec_verify_steps)
        yield counter("plait_spec_draft_tokens", "Speculative draft tokens proposed.", s.spec_draft_tokens)
        yield counter("plait_spec_accepted_tokens", "Speculative draft tokens accepted.", s.spec_accepted_tokens)


class Metrics:
    """The front's series (requests, latencies: the whole server) and each engine
    replica's (``stats()``: their latest :class:`EngineStats`, by rank)."""

    def __init__(self, model: str, stats: Callable[[], list[EngineStats]], dp_size: int = 1) -> None:
        disable_created_metrics()  # no `_created` series (this runs in the front process only)
        self.registry = CollectorRegistry()
        self.model = model
        r = self.registry
        self.requests = Counter("plait_requests", "Finished requests (sequences) by finish reason.",
                                ["model_name", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("plait_prompt_tokens", "Prompt tokens of finished sequences.",
                                     ["model_name"], registry=r)
        self.generation_tokens = Counter("plait_generation_tokens", "Generated tokens of finished sequences.",
                                         ["model_name"], registry=r)
        self.ttft = Histogram("plait_time_to_first_token_seconds", "Time to first token.",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("plait_time_per_output_token_seconds", "Mean time per output token after the first.",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("plait_inter_token_latency_seconds", "Time between streamed tokens.",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("plait_e2e_request_latency_seconds", "Arrival to last token.",
                             ["model_name"], buckets=_E2E_BUCKETS, registry=r)
        self.engine_restarts = Counter("plait_engine_restarts", "Engine processes restarted after dying.",
                                       ["model_name", "replica"], registry=r)
        for rank in range(dp_size):
            self.engine_restarts.labels(model, str(rank))  # exported from the start, at 0
        r.register(_EngineCollector(stats, model))

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int,
                 e2e: float, ttft: float | None) -> None:
        m = self.model
        self.requests.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.e2e.labels(m).observe(e2e)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            if completion_tokens > 1:
                self.tpot.labels(m).observe(max(e2e - ttft, 0.0) / (completion_tokens - 1))

    def inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
