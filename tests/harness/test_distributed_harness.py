"""The distributed harness itself: results, failures, hangs, crashes and isolation."""

import gc
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from mcore_testing.distributed import DistributedTestError, _only_gloo_failed_to_connect, _Rank


def _all_reduce_rank() -> tuple[int, int, float]:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(run_distributed, world_size):
    results = run_distributed(_all_reduce_rank, world_size)
    expected_sum = world_size * (world_size + 1) / 2
    assert results == [(rank, world_size, expected_sum) for rank in range(world_size)]


def _scaled_sum(scale, *, offset):
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return scale * value.item() + offset


def test_arguments_reach_every_rank(run_distributed):
    assert run_distributed(_scaled_sum, 3, 2.0, offset=1.0) == [7.0, 7.0, 7.0]


def test_closures_run_without_pickling(run_distributed):
    local_tensor = torch.arange(4.0)

    def body():
        return (local_tensor * dist.get_rank()).tolist()

    assert run_distributed(body, 2) == [[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0]]


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 waits for a peer that never arrives


def test_a_failing_rank_is_reported_with_its_traceback(run_distributed):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_fail_on_rank_one, 2, timeout=20)
    message = str(error.value)
    first_report = message.split("--- ")[1]
    assert first_report.startswith("rank 1 (exit code 0): Traceback")
    assert "in _fail_on_rank_one" in first_report
    assert first_report.rstrip().endswith("ValueError: rank one refuses")
    # Rank 0, left alone in the barrier, fails or is stopped soon after, not at the 20 s timeout.
    assert "--- rank 0" in message
    assert time.monotonic() - start < 15


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(600)


def test_a_hung_rank_times_out_and_shows_where_it_was(run_distributed):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_hang_on_rank_zero, 2, timeout=2)
    elapsed = time.monotonic() - start
    message = str(error.value)
    assert "1 of 2 ranks failed" in message
    assert "rank 0" in message and "did not finish within 2 s" in message
    assert "_hang_on_rank_zero" in message  # the stack faulthandler captured
    assert elapsed < 10


def _hang_in_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins


def test_a_collective_missing_a_peer_fails_well_under_a_minute(run_distributed):
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 0"):
        run_distributed(_hang_in_collective, 2, timeout=3)
    assert time.monotonic() - start < 10


def _crash_rank_one():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_crashed_rank_is_reported(run_distributed):
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_crash_rank_one, 2, timeout=10)
    assert "rank 1 (killed by SIGKILL): exited without reporting a result" in str(error.value)


def _store_key_seen_before():
    store = dist.distributed_c10d._get_default_store()
    seen = store.check(["left-by-an-earlier-call"])
    dist.barrier()
    store.set("left-by-an-earlier-call", "x")
    dist.barrier()
    return seen


def test_each_call_gets_a_fresh_rendezvous(run_distributed):
    assert run_distributed(_store_key_seen_before, 2) == [False, False]
    assert run_distributed(_store_key_seen_before, 2) == [False, False]


def test_no_rank_process_outlives_the_call(run_distributed):
    run_distributed(_all_reduce_rank, 2)
    with pytest.raises(DistributedTestError):
        run_distributed(_hang_on_rank_zero, 2, timeout=1)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # no children left, not even zombies


def _init_from_environment():
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank, os.environ["WORLD_SIZE"]


def test_ranks_can_set_up_the_group_themselves(run_distributed):
    results = run_distributed(_init_from_environment, 2, init_process_group=False)
    assert results == [(0, "2"), (1, "2")]


def test_the_default_group_is_left_after_each_call(run_distributed):
    assert run_distributed(dist.is_initialized, 2) == [True, True]
    assert not dist.is_initialized()  # the test process itself never joins


def test_bad_arguments_are_rejected(run_distributed):
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_all_reduce_rank, 0)
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_all_reduce_rank, 2, timeout=0)


def test_tests_using_the_harness_are_marked_distributed(request, run_distributed):
    assert request.node.get_closest_marker("distributed") is not None


def test_tests_not_using_it_are_not(request):
    assert request.node.get_closest_marker("distributed") is None


def _fail_to_connect_once(marker_dir):
    first_attempt = not (marker_dir / f"ran-{dist.get_rank()}").exists()
    (marker_dir / f"ran-{dist.get_rank()}").touch()
    if first_attempt and dist.get_rank() == 1:
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:561] Connection closed by peer")
    return "second attempt"


def test_a_gloo_connection_failure_is_retried_once(run_distributed, tmp_path):
    with pytest.warns(UserWarning, match="gloo could not connect"):
        assert run_distributed(_fail_to_connect_once, 2, tmp_path) == ["second attempt"] * 2


def _never_connect():
    raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:561] Connection closed by peer")


def test_a_lasting_gloo_connection_failure_fails(run_distributed):
    with pytest.warns(UserWarning), pytest.raises(DistributedTestError, match="connectFullMesh"):
        run_distributed(_never_connect, 2)


def _tensor_of_rank():
    return torch.full((2, 3), float(dist.get_rank()))


def test_tensors_come_back_by_value(run_distributed):
    results = run_distributed(_tensor_of_rank, 2)
    assert [result.tolist() for result in results] == [[[0.0] * 3] * 2, [[1.0] * 3] * 2]


def _unpicklable():
    return lambda: None


def test_an_unpicklable_result_is_reported(run_distributed):
    with pytest.raises(DistributedTestError, match="pickle"):
        run_distributed(_unpicklable, 2)


class _HangsOutsideItsProcess:
    """Cyclic garbage whose finalizer never returns in a forked child, like a gloo process group
    left for the collector, whose destructor joins worker threads the child does not have."""

    def __init__(self):
        self.creator, self.cycle = os.getpid(), self

    def __del__(self):
        while os.getpid() != self.creator:
            time.sleep(1)


def _collect() -> bool:
    gc.collect()
    return True


def test_ranks_do_not_collect_the_parents_garbage(run_distributed):
    gc.disable()
    try:
        _HangsOutsideItsProcess()  # garbage at once, left for the collector by its cycle
        assert run_distributed(_collect, 2, timeout=30) == [True, True]
    finally:
        gc.enable()
        gc.collect()  # its finalizer returns in this process


def _rank_zero_is_alive_when_rank_one_finishes():
    store = dist.distributed_c10d._get_default_store()
    store.set(f"pid-{dist.get_rank()}", str(os.getpid()))
    if dist.get_rank() == 0:
        return None
    time.sleep(0.5)  # rank 0's body has long returned
    rank_zero = int(store.get("pid-0"))
    return Path(f"/proc/{rank_zero}/status").read_text().split("State:")[1].split()[0]


def test_no_rank_exits_before_every_body_returned(run_distributed):
    # A rank exiting early closes sockets a peer may still be handshaking on (gloo's
    # "connectFullMesh failed ... Connection closed by peer").
    assert run_distributed(_rank_zero_is_alive_when_rank_one_finishes, 2)[1] in {"S", "R"}


def _finished_rank(failure: str, reported_at: float) -> _Rank:
    rank = _Rank(0, 0, None, Path())
    rank.reported, rank.succeeded, rank.failure, rank.reported_at = True, not failure, failure, reported_at
    return rank


@pytest.mark.parametrize(
    ("failures", "repeated"),
    [
        (["Gloo connectFullMesh failed with ...", "stopped after a peer failed; it was here"], True),
        (["Gloo connectFullMesh failed with ...", "Gloo connectFullMesh failed with ..."], True),
        (["AssertionError: 1 != 2", "stopped after a peer failed; it was here"], False),
        (["Gloo connectFullMesh failed with ...", "AssertionError: 1 != 2"], False),
        (["stopped after a peer failed", "Gloo connectFullMesh failed with ..."], False),
        (["", ""], False),
    ],
)
def test_only_a_run_stopped_by_gloo_connecting_is_repeated(failures, repeated):
    ranks = [_finished_rank(failure, at) for at, failure in enumerate(failures)]
    assert _only_gloo_failed_to_connect(ranks) is repeated
