"""RNG streams: dropout differs across TP ranks inside fork() and agrees across DP ranks; checkpoint replays it."""

import pytest
import torch
import torch.nn.functional as F
from mcore_parallel import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    initialize_model_parallel,
    model_parallel_manual_seed,
    parallel_state,
)


def _dropout_masks():
    initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        model_parallel_manual_seed(1234, parallel_state.get_tensor_model_parallel_rank())
        with get_rng_tracker().fork():
            inside = F.dropout(torch.ones(64), p=0.5)
        outside = F.dropout(torch.ones(64), p=0.5)
        return inside.tolist(), outside.tolist()
    finally:
        parallel_state.destroy_model_parallel()


def test_dropout_differs_per_tp_rank_and_agrees_per_dp_rank(run_distributed):
    # tp=2, dp=2: ranks 0 and 2 are TP rank 0, ranks 1 and 3 TP rank 1.
    results = run_distributed(_dropout_masks, 4)
    inside = [r[0] for r in results]
    outside = [r[1] for r in results]
    assert inside[0] == inside[2] and inside[1] == inside[3]
    assert inside[0] != inside[1]
    assert outside[0] == outside[1] == outside[2] == outside[3]
    assert outside[0] != inside[0]


def test_fork_leaves_the_default_stream_untouched():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 11)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)
    with tracker.fork("a"):
        second = torch.rand(3)
    torch.manual_seed(11)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))  # the stream continues where it stopped


def test_tracker_rejects_reused_names_and_seeds_and_unknown_streams():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(KeyError, match="'missing' does not exist"):
        with tracker.fork("missing"):
            pass


def test_states_round_trip():
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 3)
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(4), first)


def _block(x, weight):
    """Dropout from both the default stream and the tracked one, so recomputation must restore both."""
    hidden = F.dropout(x @ weight, p=0.3)
    with get_rng_tracker().fork():
        hidden = F.dropout(torch.tanh(hidden), p=0.3)
    return hidden * 2


@pytest.fixture
def global_tracker_emptied():
    """Empty the process-wide tracker after the test seeded it: ranks that later tests fork from this
    process inherit it, and a stream left behind changes their dropout masks."""
    yield
    get_rng_tracker().reset()


@pytest.mark.usefixtures("global_tracker_emptied")
def test_checkpoint_recomputes_with_the_same_random_state():
    weight = torch.randn(6, 6)
    x = torch.randn(4, 6)

    def run(use_checkpoint):
        model_parallel_manual_seed(99, tp_rank=0, device="cpu")
        w = weight.clone().requires_grad_()
        inp = x.clone().requires_grad_()
        out = checkpoint(_block, inp, w) if use_checkpoint else _block(inp, w)
        after = torch.rand(2)  # the default stream must continue as if nothing was recomputed
        (out * torch.arange(6.0)).sum().backward()
        return out.detach(), inp.grad, w.grad, after, torch.rand(2)

    plain = run(False)
    checkpointed = run(True)
    for a, b in zip(plain, checkpointed, strict=True):
        assert torch.equal(a, b)
    assert (plain[0] == 0).any()  # dropout did drop something, so the comparison means something
