"""The server's Prometheus metrics, in a registry of its own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..client import CoordinatorStatus

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Counters, gauges and histograms of one server, exposed by ``GET /metrics``.

    ``mcore_requests_running`` / ``mcore_requests_waiting``: requests on an engine / waiting for
    one at the coordinator, ``mcore_engines_live``, ``mcore_kv_cache_usage_ratio`` and the
    prefix cache's ``mcore_prefix_cache_hit_tokens``, ``mcore_prefix_cache_queried_tokens`` and
    ``mcore_prefix_cache_hit_rate``, as of the last scrape (from the coordinator's status). ``mcore_prompt_tokens_total`` / ``mcore_generation_tokens_total``:
    tokens of finished requests. ``mcore_time_to_first_token_seconds``,
    ``mcore_inter_token_latency_seconds``, ``mcore_e2e_request_latency_seconds``: as the server
    sees them. ``mcore_requests_total{outcome}``: each engine request once it ends, by outcome
    (``stop``, ``length``, ``abort``, ``error``), and ``mcore_http_requests_rejected_total{status}``:
    requests answered with an error before reaching an engine."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("mcore_requests_running", "Requests on an engine.", registry=r)
        self.waiting = Gauge("mcore_requests_waiting", "Requests waiting for an engine.", registry=r)
        self.engines = Gauge("mcore_engines_live", "Live engines behind the coordinator.", registry=r)
        self.kv_cache_usage = Gauge(
            "mcore_kv_cache_usage_ratio", "Mean share of KV-cache blocks held by requests.", registry=r
        )
        self.prefix_hit_tokens = Gauge(
            "mcore_prefix_cache_hit_tokens",
            "Prompt tokens served from the engines' prefix caches.",
            registry=r,
        )
        self.prefix_query_tokens = Gauge(
            "mcore_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix caches.", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "mcore_prefix_cache_hit_rate", "Prefix-cache hit tokens over looked-up tokens.", registry=r
        )
        self.prompt_tokens = Counter("mcore_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            "mcore_generation_tokens", "Generated tokens of finished requests.", registry=r
        )
        self.time_to_first_token = Histogram(
            "mcore_time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            "mcore_inter_token_latency_seconds", "Time between tokens.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e_latency = Histogram(
            "mcore_e2e_request_latency_seconds",
            "End-to-end request time.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.outcomes = Counter("mcore_requests", "Engine requests by outcome.", ["outcome"], registry=r)
        self.rejected = Counter(
            "mcore_http_requests_rejected", "HTTP requests answered with an error.", ["status"], registry=r
        )

    def set_status(self, status: CoordinatorStatus) -> None:
        """Update the gauges from the coordinator's status."""
        self.running.set(status.requests - status.waiting)
        self.waiting.set(status.waiting)
        self.engines.set(status.engines)
        self.kv_cache_usage.set(status.kv_cache_usage)
        self.prefix_hit_tokens.set(status.prefix_cache_hit_tokens)
        self.prefix_query_tokens.set(status.prefix_cache_query_tokens)
        queried = status.prefix_cache_query_tokens
        self.prefix_hit_rate.set(status.prefix_cache_hit_tokens / queried if queried else 0.0)

    def finished(self, outcome: str, prompt_tokens: int, generated_tokens: int, seconds: float) -> None:
        """Count one engine request that ended."""
        self.outcomes.labels(outcome=outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.e2e_latency.observe(seconds)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
