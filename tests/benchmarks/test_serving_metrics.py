"""``benchmarks/serving.py``'s figures and arrival schedule, against hand-computed values and
numpy's percentiles."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serving_client import arrival_delays
from serving_metrics import RequestRecord, percentile, summarize


def _records() -> list[RequestRecord]:
    return [
        RequestRecord(40, 11, success=True, ttft=0.1, latency=1.1, itl=[0.1] * 10, output_tokens=11),
        RequestRecord(
            60, 5, success=True, ttft=0.3, latency=0.7, itl=[0.05, 0.15, 0.1, 0.1], output_tokens=5
        ),
        RequestRecord(50, 8, error="HTTP 500: boom"),
    ]


def test_summary_matches_hand_computed_figures():
    summary = summarize(_records(), duration=2.0)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert (summary["prompt_tokens"], summary["output_tokens"]) == (100, 16)  # the failed one not counted
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx(8.0)
    assert summary["mean_ttft_ms"] == pytest.approx(200.0)
    assert summary["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["p99_ttft_ms"] == pytest.approx(298.0)  # 100 + 0.99 * (300 - 100)
    # TPOT: (1.1 - 0.1) / 10 and (0.7 - 0.3) / 4, both 100 ms
    assert summary["median_tpot_ms"] == pytest.approx(100.0)
    assert summary["p99_tpot_ms"] == pytest.approx(100.0)
    # ITL: fourteen gaps; sorted, 0.05, then twelve of 0.1, then 0.15
    assert summary["median_itl_ms"] == pytest.approx(100.0)
    assert summary["p99_itl_ms"] == pytest.approx(100.0 + 0.87 * 50.0)  # rank 12.87 of 0..13
    assert summary["mean_e2el_ms"] == pytest.approx(900.0)


def test_percentile_is_numpys_linear_interpolation():
    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 100):
        values = rng.exponential(size=size).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert math.isnan(percentile([], 50))


def test_no_completed_request_gives_nan_latencies_not_an_error():
    summary = summarize([RequestRecord(10, 4, error="refused")], duration=1.0)
    assert summary["completed"] == 0 and summary["request_throughput"] == 0
    assert math.isnan(summary["median_ttft_ms"])


def test_infinite_rate_sends_everything_at_once():
    assert arrival_delays(5, float("inf")) == [0.0] * 5


def test_poisson_arrivals_have_the_asked_rate_and_repeat_per_seed():
    delays = arrival_delays(20000, rate=4.0, seed=3)
    gaps = np.diff(delays)
    assert delays[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: standard deviation = mean
    assert arrival_delays(50, 4.0, seed=3) == delays[:50]
    assert arrival_delays(50, 4.0, seed=4) != delays[:50]


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_a_rate_that_is_not_positive_is_refused(rate):
    with pytest.raises(ValueError, match="request rate must be > 0"):
        arrival_delays(3, rate)
