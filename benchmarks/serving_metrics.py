"""The figures of a serving run, as ``vllm bench serve`` defines them, from per-request records.

TTFT: from sending a request to its first streamed token. TPOT: (latency - TTFT) / (output
tokens - 1) per request with more than one token. ITL: every gap between two streamed chunks
that carry text, over all requests. E2E latency: from sending to the last chunk. Request and
output-token throughput: completed requests and their output tokens over the run's duration
(first request sent to last request finished).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILES = (50, 99)


@dataclass
class RequestRecord:
    """One request's outcome; times in seconds from when it was sent."""

    prompt_tokens: int
    output_tokens_asked: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0  # what the server's usage reported


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks, as numpy's default."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _latency_figures(name: str, values: list[float]) -> dict[str, float]:
    figures = {f"mean_{name}_ms": 1e3 * sum(values) / len(values) if values else math.nan}
    for q in PERCENTILES:
        label = "median" if q == 50 else f"p{q}"
        figures[f"{label}_{name}_ms"] = 1e3 * percentile(values, q)
    return figures


def summarize(records: list[RequestRecord], duration: float) -> dict[str, float]:
    """Counts, throughputs and the mean, median and p99 (ms) of TTFT, TPOT, ITL and E2E latency."""
    done = [r for r in records if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, float] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
    }
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary.update(_latency_figures("ttft", [r.ttft for r in done]))
    summary.update(_latency_figures("tpot", tpot))
    summary.update(_latency_figures("itl", [gap for r in done for gap in r.itl]))
    summary.update(_latency_figures("e2el", [r.latency for r in done]))
    return summary
