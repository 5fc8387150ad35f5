"""Utilities: device/backend choice, free ports, timers, straggler detection, NVTX, gradient comparison."""

import math
import socket

import pytest
import torch
import torch.distributed as dist
from mcore_parallel import (
    StragglerDetectionConfig,
    StragglerDetector,
    Timer,
    Timers,
    broadcast_free_port,
    check_gradient,
    ephemeral_port_range,
    expected_error_bound,
    find_free_port,
    get_backend,
    get_device,
    nvtx_range,
    relative_difference,
    sharded_frobenius_norm,
)


def test_backend_and_device_follow_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert get_backend() == "gloo" and get_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert get_backend() == "nccl" and get_device() == torch.device("cuda", 3)
    assert get_device(1) == torch.device("cuda", 1)


def test_free_port_is_in_the_ephemeral_range_and_bindable():
    low, high = ephemeral_port_range()
    port = find_free_port()
    assert low <= port <= high
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def _port_from_first_rank():
    group = dist.new_group([1, 2])  # a subgroup whose first rank is global rank 1
    port = broadcast_free_port(group) if dist.get_rank() in (1, 2) else None
    return broadcast_free_port(), port


def test_port_is_broadcast_from_the_first_rank(run_distributed):
    results = run_distributed(_port_from_first_rank, 3)
    assert len({world for world, _ in results}) == 1
    assert results[0][1] is None and results[1][1] == results[2][1] is not None


def test_timer_totals_averages_and_injected_values():
    timer = Timer("step")
    for seconds in (5.0, 1.0, 3.0):  # the first interval is warm-up
        timer.set_elapsed(seconds)
    assert timer.count == 3 and timer.average() == 2.0
    assert timer.elapsed() == 9.0 and timer.elapsed() == 0.0  # reset by default
    timer.start()
    with pytest.raises(RuntimeError, match="already running"):
        timer.start()
    measured = timer.stop()
    assert measured >= 0 and timer.elapsed(reset=False) == measured
    with pytest.raises(RuntimeError, match="not running"):
        timer.stop()
    with pytest.raises(ValueError, match=">= 0 seconds"):
        timer.set_elapsed(-1.0)
    single = Timer("once")
    single.set_elapsed(4.0)
    assert single.average() == 4.0


def test_timers_registry_and_startup_phases():
    timers = Timers()
    timers("forward").set_elapsed(0.5)
    timers.set_elapsed("backward", 1.5)
    assert timers.names() == ["forward", "backward"] and timers("forward") is timers("forward")
    with timers.startup_phase("init"):
        pass
    with timers.startup_phase("model"):
        pass
    phases = timers.startup_phases()
    assert list(phases) == ["init", "model"] and all(v >= 0 for v in phases.values())
    with pytest.raises(ValueError, match="'init' was already recorded"):
        with timers.startup_phase("init"):
            pass


def _timers_across_ranks():
    timers = Timers()
    timers.set_elapsed("step", 1.0 + dist.get_rank())
    if dist.get_rank() == 0:
        timers.set_elapsed("only-rank-0", 2.0)
    return timers.min_max_across_ranks(["step", "only-rank-0"])


def test_timers_min_and_max_across_ranks(run_distributed):
    results = run_distributed(_timers_across_ranks, 3)
    assert results == [{"step": (1.0, 3.0), "only-rank-0": (0.0, 2.0)}] * 3


def _straggler_reports(times, threshold, calc):
    detector = StragglerDetector(threshold_relative_stddev=threshold, calc_relative_stddev=calc)
    for t in times[dist.get_rank()]:
        detector.record(t)
    return detector.report()


def test_straggler_detector_names_the_slow_rank(run_distributed):
    times = [[1.0, 1.0], [0.9, 1.1], [1.0, 1.0], [2.0, 2.0]]  # means 1, 1, 1, 2
    reports = run_distributed(_straggler_reports, 4, times, 0.1, True)
    report = reports[0]
    assert all(r == report for r in reports)
    assert report.step_times == [1.0, 1.0, 1.0, 2.0]
    assert report.mean == 1.25
    assert math.isclose(report.relative_stddev, math.sqrt(0.1875) / 1.25)
    assert report.slow_ranks == [3] and report.straggling
    assert "slow ranks: [3]" in str(report)


def test_straggler_detector_quiet_below_threshold_or_when_disabled(run_distributed):
    even = run_distributed(_straggler_reports, 2, [[1.0], [1.05]], 0.1, True)
    assert even[0].slow_ranks == [] and not even[0].straggling
    unchecked = run_distributed(_straggler_reports, 2, [[1.0], [3.0]], 0.1, False)
    assert unchecked[0].slow_ranks == [] and unchecked[0].relative_stddev == 0.5


def _maybe_report(interval):
    config = StragglerDetectionConfig(enabled=True, report_time_interval=interval)
    detector = StragglerDetector.from_config(config)
    detector.record(1.0)
    return detector.maybe_report() is not None


def test_maybe_report_agrees_across_ranks(run_distributed):
    assert run_distributed(_maybe_report, 2, 1e-9) == [True, True]
    assert run_distributed(_maybe_report, 2, 3600.0) == [False, False]


def test_nvtx_range_is_a_no_op_without_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    with nvtx_range("step"):
        pass
    assert calls == []


def test_nvtx_range_pushes_and_pops_with_cuda_even_on_error(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))

    @nvtx_range("decorated")
    def work():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        work()
    assert calls == [("push", "decorated"), ("pop",)]


def _nvtx_on_cuda():
    with nvtx_range("gpu-range"):
        return torch.ones(1, device="cuda").add_(1).item()


@pytest.mark.gpu
def test_nvtx_range_on_a_gpu(run_distributed):
    assert run_distributed(_nvtx_on_cuda, 1, timeout=120) == [2.0]


def test_relative_difference_and_error_bound():
    reference = torch.tensor([3.0, 4.0])
    assert relative_difference(reference + torch.tensor([0.3, 0.4]), reference) == pytest.approx(0.1)
    assert relative_difference(torch.tensor([0.0, 1e-3]), torch.zeros(2)) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="shapes differ"):
        relative_difference(torch.zeros(2), torch.zeros(3))
    assert expected_error_bound(torch.float32, 2) == pytest.approx(8 * 2**-23 * 2)
    assert expected_error_bound(torch.bfloat16, 1) > expected_error_bound(torch.float32, 10)
    with pytest.raises(ValueError, match="depth must be >= 1"):
        expected_error_bound(torch.float32, 0)


def test_check_gradient_reports_error_bound_and_verdict():
    reference = torch.randn(100, dtype=torch.float64)
    close = check_gradient(reference.float(), reference, depth=1)
    assert close.ok and close.error <= close.bound == expected_error_bound(torch.float32, 1)
    far = check_gradient(reference.float() * 1.01, reference, depth=1)
    assert not far.ok and far.error == pytest.approx(0.01, rel=1e-3)
    bf16 = check_gradient(reference.bfloat16(), reference, depth=1)
    assert bf16.ok and bf16.bound == expected_error_bound(torch.bfloat16, 1)


def _sharded_norm():
    full = torch.arange(12.0).view(3, 4)
    shards = [full.chunk(2, dim=1)[dist.get_rank()], torch.full((2,), float(dist.get_rank()))]
    return sharded_frobenius_norm(shards)


def test_frobenius_norm_over_shards(run_distributed):
    expected = math.sqrt(sum(v * v for v in range(12)) + 2 * 1.0)
    assert run_distributed(_sharded_norm, 2) == [pytest.approx(expected)] * 2
